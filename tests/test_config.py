import pytest
import yaml

from gsm8kctl.config import default_config, load_config, parse_override, save_config
from gsm8kctl.errors import UserError

ORIGINAL = (
    "finetune.rl.algo=reinforce finetune.train_batch_size=4 finetune.gradient_accumulation_passes=1 "
    "finetune.rl.implicit_kl_coef=0.0 finetune.rl.kl_coef=0.0 finetune.rl.use_advantages=false "
    "+finetune.rl.relu_weights=true use_rejection_sampling=true test_every_n_iterations=5 "
    "finetune.learning_rate=0.000001 finetune.gradient_clipping_threshold=1.0 "
    "finetune.save_checkpoint_steps=8 finetune.weight_decay=0.1 max_agent_forks=5000 attempts=8"
).split()


def test_original_command_line_parses_into_expected_config():
    cfg = load_config(None, ORIGINAL)
    ft = cfg["finetune"]
    assert ft["rl"]["algo"] == "reinforce"
    assert ft["train_batch_size"] == 4
    assert ft["rl"]["use_advantages"] is False
    assert ft["rl"]["relu_weights"] is True
    assert ft["learning_rate"] == pytest.approx(1e-6)
    assert isinstance(ft["learning_rate"], float)
    assert ft["save_checkpoint_steps"] == 8
    assert cfg["max_agent_forks"] == 5000 and cfg["attempts"] == 8
    assert cfg["test_every_n_iterations"] == 5 and cfg["use_rejection_sampling"] is True


def test_scientific_notation_without_dot_is_a_number():
    assert parse_override("finetune.learning_rate=1e-6") == ("finetune.learning_rate", 1e-6)


def test_unknown_key_suggests_closest():
    with pytest.raises(UserError, match=r"unknown config key 'finetune.learnig_rate'.*finetune.learning_rate"):
        load_config(None, ["finetune.learnig_rate=1"])


def test_wrong_type_is_refused():
    with pytest.raises(UserError, match="expects a number"):
        load_config(None, ["attempts=many"])
    with pytest.raises(UserError, match="expects true or false"):
        load_config(None, ["use_rejection_sampling=3"])


def test_override_without_equals():
    with pytest.raises(UserError, match="expected key=value"):
        load_config(None, ["attempts"])


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("attempts: 4\nsampling:\n  temperature: 0.7\n")
    cfg = load_config(f, ["attempts=2"])
    assert cfg["attempts"] == 2 and cfg["sampling"]["temperature"] == 0.7
    assert cfg["sampling"]["top_p"] == default_config()["sampling"]["top_p"]


def test_bad_yaml_file_names_file_and_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("attempts: 4\nsampling: [\n")
    with pytest.raises(UserError, match=r"bad.yaml:\d+: invalid YAML"):
        load_config(f)


def test_unknown_key_in_file_names_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("atempts: 4\n")
    with pytest.raises(UserError, match=r"c.yaml: unknown config key 'atempts'.*attempts"):
        load_config(f)


def test_presets_are_valid():
    from pathlib import Path

    for preset in sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml")):
        load_config(preset)


def test_save_roundtrip(tmp_path):
    cfg = load_config(None, ["attempts=3"])
    save_config(cfg, tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == cfg

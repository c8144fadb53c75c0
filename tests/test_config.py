import copy
import re
import typing
from pathlib import Path

import pytest
import yaml

from gsm8kctl.config import default_config, load_config, parse_override, save_config, schema, set_value, validate
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
    with pytest.raises(UserError, match="attempts must be an integer, got 'many'"):
        load_config(None, ["attempts=many"])
    with pytest.raises(UserError, match="use_rejection_sampling must be true or false, got 3"):
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


PRESETS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_presets_are_valid(preset):
    load_config(preset, command="loop")  # the loop's own rules too: presets are loop configs


def test_save_roundtrip(tmp_path):
    cfg = load_config(None, ["attempts=3"])
    save_config(cfg, tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == cfg


# ---------------------------------------------------------------------------------------------
# The schema: default.yaml and config/schema.py describe the same keys


def _flat(cfg: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in cfg.items():
        out.append(prefix + k)
        if isinstance(v, dict):
            out.extend(_flat(v, f"{prefix}{k}."))
    return out


def test_every_default_key_has_a_schema_field_and_back():
    in_yaml, in_schema = _flat(default_config()), schema.dotted_keys()
    assert sorted(set(in_yaml) - set(in_schema)) == [], "keys of default.yaml without a schema field"
    assert sorted(set(in_schema) - set(in_yaml)) == [], "schema fields missing from default.yaml"
    assert in_yaml == in_schema, "same keys, same order: the schema mirrors the YAML"


def test_schema_accepts_default_yaml_exactly():
    """The defaults are canonical: checking them changes nothing (a float default is written 1.0)."""
    cfg = default_config()
    assert validate(copy.deepcopy(cfg)) == cfg
    assert load_config() == cfg
    # With each command's rules too.
    for command in ("sample", "evaluate", "filter", "finetune", "loop"):
        load_config(command=command)


def test_every_yaml_key_is_commented_or_self_explanatory():
    """default.yaml is what users read: the enumerations it documents are the schema's."""
    text = (Path(schema.__file__).parent / "default.yaml").read_text()
    assert "backend: auto                # auto | transformers | vllm | openai" in text
    for key in ("max_slots", "kv_memory_fraction", "prefill_token_budget", "write_interval_s"):
        assert re.search(rf"^  {key}: .*# ", text, re.M), f"sampling.{key} needs a comment"


def test_new_sampler_keys():
    s = default_config()["sampling"]
    assert s["max_slots"] is None and s["kv_memory_fraction"] == 0.3 and s["prefill_token_budget"] == 32768
    assert load_config(None, ["sampling.max_slots=256"])["sampling"]["max_slots"] == 256


def test_enumerations_agree_with_the_code():
    from gsm8kctl import agent
    from gsm8kctl.sampling import backends
    from gsm8kctl.stages import finetune
    from gsm8kctl.training import losses

    def choices(tp):
        return set(typing.get_args(schema._split(tp)[0]))

    assert choices(schema.Backend) == set(backends.BACKENDS)
    assert choices(schema.Extractor) == set(agent.EXTRACTORS)
    assert choices(schema.KLEstimator) == set(losses.KL_ESTIMATORS)
    assert choices(schema.Objective) == set(finetune.OBJECTIVES)
    assert choices(schema.RLAlgo) <= set(finetune.OBJECTIVES)
    from gsm8kctl.training import trainer as training

    for v in choices(schema.AutoBool):  # finetune.compile's and finetune.packing's parsers accept each
        training._compile_wanted(v, cuda=False)
        assert training._packing_wanted(v, cuda=True) == (v != False)  # noqa: E712


# ---------------------------------------------------------------------------------------------
# Bad values: each refused at load, naming the key (>= 30 rows)

BAD = [
    # (override, the key named, a fragment of the reason)
    ("attempts=-1", "attempts", "must be >= 1, got -1"),
    ("attempts=0", "attempts", "must be >= 1, got 0"),
    ("attempts=2.5", "attempts", "must be an integer"),
    ("attempts=true", "attempts", "must be an integer"),
    ("iterations=-1", "iterations", ">= 0"),
    ("max_agent_forks=0", "max_agent_forks", ">= 1"),
    ("use_rejection_sampling=maybe", "use_rejection_sampling", "true or false"),
    ("test_before_warmup=yes please", "test_before_warmup", "true or false"),
    ("test_every_n_iterations=-2", "test_every_n_iterations", ">= 0"),
    ("eval_limit=0", "eval_limit", ">= 1 or null"),
    ("warmup_sft_steps=-1", "warmup_sft_steps", ">= 0"),
    ("warmup_sft_problems=-1", "warmup_sft_problems", ">= 0"),
    ("warmup_sft_learning_rate=0", "warmup_sft_learning_rate", "> 0 or null"),
    ("data_dir=' '", "data_dir", "must not be empty"),
    ("report_to=mlflow", "report_to", "got 'mlflow'"),
    ("report_to=5", "report_to", "must be a list"),
    ("backend=tensorrt", "backend", "one of auto, transformers, vllm, openai"),
    ("seed=-1", "seed", "in [0, 2147483647]"),
    ("machine=tpu", "machine", "must be one of auto, gpu, cpu"),
    ("validation_problems=-1", "validation_problems", ">= 0"),
    ("stop_without_signal=-2", "stop_without_signal", ">= 0"),
    ("revisit_share=1.5", "revisit_share", "in [0, 1]"),
    ("gpu_memory_share=0", "gpu_memory_share", "in (0, 1]"),
    ("gpu_memory_share=1.5", "gpu_memory_share", "in (0, 1]"),
    ("gpu_memory_share=half", "gpu_memory_share", "must be a number in (0, 1] or one of auto"),
    ("model=", "model", "must be a string"),
    ("model=' '", "model", "must not be empty"),
    ("agent.reward_extractor=bogus", "agent.reward_extractor", "one of strict, lenient, got 'bogus'"),
    ("agent.few_shot=-1", "agent.few_shot", ">= 0"),
    ("agent.task_template=no placeholder", "agent.task_template", "must contain {question}"),
    ("agent.task_template='{question} {answer}'", "agent.task_template", "only the placeholder {question}"),
    ("sampling.temperature=-1", "sampling.temperature", "must be >= 0, got -1"),
    ("sampling.temperature=hot", "sampling.temperature", "must be a number"),
    ("sampling.temperature=.inf", "sampling.temperature", "finite"),
    ("sampling.top_p=0", "sampling.top_p", "in (0, 1], got 0"),
    ("sampling.top_p=1.5", "sampling.top_p", "in (0, 1]"),
    ("sampling.max_tokens=0", "sampling.max_tokens", ">= 1"),
    ("sampling.batch_size=0", "sampling.batch_size", ">= 1"),
    ("sampling.max_slots=0", "sampling.max_slots", ">= 1 or null"),
    ("sampling.kv_memory_fraction=0", "sampling.kv_memory_fraction", "in (0, 0.95]"),
    ("sampling.kv_memory_fraction=0.99", "sampling.kv_memory_fraction", "in (0, 0.95]"),
    ("sampling.prefill_token_budget=0", "sampling.prefill_token_budget", ">= 1"),
    ("sampling.write_interval_s=-1", "sampling.write_interval_s", ">= 0"),
    ("evaluation.max_tokens=-5", "evaluation.max_tokens", ">= 1"),
    ("evaluation.batch_size=0", "evaluation.batch_size", ">= 1"),
    ("transformers.static_cache=sometimes", "transformers.static_cache", "one of auto, true, false"),
    ("transformers.static_cache=1", "transformers.static_cache", "one of auto, true, false, got 1"),
    ("transformers.dtype=fp16", "transformers.dtype", "one of auto, float32, bfloat16"),
    ("transformers.decode_attention=xformers", "transformers.decode_attention", "one of auto, split_k, flash, sdpa"),
    ("transformers.model_code=vllm", "transformers.model_code", "one of auto, native, hf"),
    ("loop.engine=threads", "loop.engine", "one of auto, inprocess, processes"),
    ("sampling.num_processes=0", "sampling.num_processes", ">= 1"),
    ("vllm.kv_cache_gb=0", "vllm.kv_cache_gb", ">= 1"),
    ("vllm.gpu_memory_utilization=0", "vllm.gpu_memory_utilization", "in (0, 1]"),
    ("vllm.gpu_memory_utilization=1.2", "vllm.gpu_memory_utilization", "in (0, 1]"),
    ("vllm.enforce_eager=2", "vllm.enforce_eager", "true or false"),
    ("vllm.dtype=fp8", "vllm.dtype", "got 'fp8'"),
    ("vllm.max_model_len=0", "vllm.max_model_len", ">= 1 or null"),
    ("vllm.max_num_seqs=-1", "vllm.max_num_seqs", ">= 1 or null"),
    ("openai.base_url=localhost:8000", "openai.base_url", "http:// or https://"),
    ("openai.concurrency=0", "openai.concurrency", ">= 1"),
    ("openai.timeout_s=0", "openai.timeout_s", "> 0"),
    ("openai.retries=-1", "openai.retries", ">= 0"),
    ("openai.backoff_s=-0.5", "openai.backoff_s", ">= 0"),
    ("filter.max_per_problem=0", "filter.max_per_problem", ">= 1 or null"),
    ("filter.drop_uniform_groups=yes please", "filter.drop_uniform_groups", "true or false"),
    ("filter.drop_duplicate_correct=2", "filter.drop_duplicate_correct", "true or false"),
    ("filter.ref_model=''", "filter.ref_model", "must not be empty"),
    ("filter.ref_backend=tgi", "filter.ref_backend", "one of auto"),
    ("filter.score_token_budget=0", "filter.score_token_budget", ">= 1"),
    ("finetune.objective=ppo", "finetune.objective", "one of sft, reinforce, grpo or null"),
    ("finetune.learning_rate=0", "finetune.learning_rate", "> 0"),
    ("finetune.learning_rate=-1e-5", "finetune.learning_rate", "> 0"),
    ("finetune.weight_decay=-0.1", "finetune.weight_decay", ">= 0"),
    ("finetune.gradient_clipping_threshold=-1", "finetune.gradient_clipping_threshold", ">= 0 or null"),
    ("finetune.lr_scheduler=cosin", "finetune.lr_scheduler",
     "one of constant, cosine, got 'cosin'; did you mean cosine?"),
    ("finetune.warmup_steps=-1", "finetune.warmup_steps", ">= 0"),
    ("finetune.train_batch_size=0", "finetune.train_batch_size", ">= 1"),
    ("finetune.gradient_accumulation_passes=0", "finetune.gradient_accumulation_passes", ">= 1"),
    ("finetune.token_budget=0", "finetune.token_budget", ">= 1"),
    ("finetune.seq_length=0", "finetune.seq_length", ">= 1"),
    ("finetune.save_checkpoint_steps=0", "finetune.save_checkpoint_steps", ">= 1 or null"),
    ("finetune.steps=0", "finetune.steps", ">= 1 or null"),
    ("finetune.max_steps=0", "finetune.max_steps", ">= 1 or null"),
    ("finetune.epochs=0", "finetune.epochs", ">= 1"),
    ("finetune.dtype=float16", "finetune.dtype", "one of auto, float32, bfloat16"),
    ("finetune.gradient_checkpointing=sure", "finetune.gradient_checkpointing", "true or false"),
    ("finetune.compile=sometimes", "finetune.compile", "one of auto, true, false"),
    ("finetune.packing=maybe", "finetune.packing", "one of auto, true, false"),
    ("finetune.logprob_chunk_tokens=0", "finetune.logprob_chunk_tokens", ">= 1"),
    ("finetune.num_processes=0", "finetune.num_processes", ">= 1"),
    ("finetune.nccl_timeout_s=0", "finetune.nccl_timeout_s", ">= 1"),
    ("finetune.keep_checkpoints=0", "finetune.keep_checkpoints", ">= 1"),
    ("finetune.rl.algo=ppo", "finetune.rl.algo", "one of reinforce, grpo"),
    ("finetune.rl.use_advantages=2", "finetune.rl.use_advantages", "true or false"),
    ("finetune.rl.relu_weights=[]", "finetune.rl.relu_weights", "true or false, got []"),
    ("finetune.rl.kl_coef=-0.1", "finetune.rl.kl_coef", ">= 0"),
    ("finetune.rl.implicit_kl_coef=-1", "finetune.rl.implicit_kl_coef", ">= 0"),
    ("finetune.rl.implicit_kl_estimator=k2", "finetune.rl.implicit_kl_estimator", "one of k1, k3"),
    ("finetune.rl.epsilon=0", "finetune.rl.epsilon", "> 0"),
    ("finetune.rl.epsilon_high=-0.1", "finetune.rl.epsilon_high", "> 0"),
    ("finetune.rl.divide_by_std=maybe", "finetune.rl.divide_by_std", "true or false"),
    ("warn_passes=0", "warn_passes", "> 0 or null"),
    ("warn_test_drop=-0.01", "warn_test_drop", ">= 0 or null"),
    ("warn_ratio=0", "warn_ratio", "> 0 or null"),
    ("warn_kl=-1", "warn_kl", ">= 0 or null"),
    ("warn_entropy=0", "warn_entropy", "> 0 or null"),
]


@pytest.mark.parametrize("override, key, reason", BAD, ids=[b[0] for b in BAD])
def test_bad_value_is_refused_naming_key_and_override(override, key, reason):
    with pytest.raises(UserError) as info:
        load_config(None, [override])
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"override '{override}': {key} "), msg
    assert reason in msg, msg


def test_table_covers_every_constrained_key():
    """Every key whose type says more than 'any string' has a row above."""
    covered = {key for _, key, _ in BAD}
    free = {"agent.system_prompt", "openai.api_key"}  # any string (or null): nothing to refuse
    leaves = [k for k in schema.dotted_keys() if not schema.is_section(schema.field_type(k))]
    assert sorted(set(leaves) - covered - free) == []


def test_bad_value_in_file_names_file(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("finetune:\n  lr_scheduler: cosin\n")
    with pytest.raises(UserError, match=re.escape(f"{f}: finetune.lr_scheduler must be one of constant, "
                                                  "cosine, got 'cosin'")):
        load_config(f)


def test_bad_value_in_option_names_option():
    with pytest.raises(UserError, match=re.escape("option --max-tokens: sampling.max_tokens must be >= 1, got 0")):
        load_config(None, [], options={"sampling.max_tokens": 0})
    # An option wins over an override of the same key...
    cfg = load_config(None, ["attempts=2"], options={"attempts": 3, "model": None})
    assert cfg["attempts"] == 3 and cfg["model"] == "smollm2-135m"
    # ... but a bad override is still refused: it would otherwise vanish without a word.
    with pytest.raises(UserError, match=re.escape("override 'attempts=0': attempts must be >= 1, got 0")):
        load_config(None, ["attempts=0"], options={"attempts": 3})
    with pytest.raises(UserError, match=re.escape("override 'sampling.max_tokens=abc': sampling.max_tokens "
                                                  "must be an integer, got 'abc'")):
        load_config(None, ["sampling.max_tokens=abc", "sampling.max_tokens=8"])


def test_bad_file_value_may_be_fixed_by_a_later_source(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("attempts: 0\n")
    assert load_config(f, ["attempts=2"])["attempts"] == 2
    assert load_config(f, options={"attempts": 3})["attempts"] == 3


def test_config_file_not_utf8_names_file_and_line(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_bytes(b"seed: 1\n\xff\xfe: 2\n")
    with pytest.raises(UserError, match=re.escape(f"{f}:2: not UTF-8 (byte 0xff at offset 8)")):
        load_config(f)


@pytest.mark.parametrize("text, line, key, first", [
    ("sampling:\n  max_tokens: 8\n  max_tokens: 16\n", 3, "max_tokens", 2),
    ("sampling:\n  top_p: 0.5\nseed: 3\nsampling:\n  max_tokens: 8\n", 4, "sampling", 1),
    ("finetune: {rl: {algo: grpo, algo: reinforce}}\n", 1, "algo", 1),
])
def test_duplicate_key_in_file_names_file_line_and_key(tmp_path, text, line, key, first):
    f = tmp_path / "x.yaml"
    f.write_text(text)
    with pytest.raises(UserError, match=re.escape(f"{f}:{line}: duplicate key '{key}' (first on line {first})")):
        load_config(f)


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    """`<<: *anchor` then a key of the anchor's is YAML's way to override it, not a repeat."""
    f = tmp_path / "x.yaml"
    f.write_text("evaluation:\n  <<: {max_tokens: 8, batch_size: 2}\n  max_tokens: 16\n")
    cfg = load_config(f)
    assert cfg["evaluation"] == {"max_tokens": 16, "batch_size": 2}


def test_later_source_is_blamed_for_its_value(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("attempts: 0\n")
    with pytest.raises(UserError, match=r"^override 'sampling.top_p=2': "):
        load_config(f, ["attempts=4", "sampling.top_p=2"])
    with pytest.raises(UserError, match=rf"^{re.escape(str(f))}: attempts must be >= 1"):
        load_config(f, ["sampling.top_p=0.5"])


def test_empty_section_in_file_is_no_change(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("sampling:\n  # temperature: 0.7\n")
    assert load_config(f)["sampling"] == default_config()["sampling"]


def test_section_given_a_value_and_value_given_a_section(tmp_path):
    with pytest.raises(UserError, match="'sampling' is a section, not a value"):
        load_config(None, ["sampling=3"])
    f = tmp_path / "x.yaml"
    f.write_text("attempts:\n  n: 3\n")
    with pytest.raises(UserError, match=rf"{re.escape(str(f))}: attempts must be an integer"):
        load_config(f)


# ---------------------------------------------------------------------------------------------
# Rules between keys


def test_loop_needs_max_agent_forks_at_least_attempts():
    with pytest.raises(UserError, match=r"^override 'attempts=1000': need max_agent_forks >= attempts"):
        load_config(None, ["attempts=1000"], command="loop")
    # The rule blames whichever of the two keys was set last.
    with pytest.raises(UserError, match=r"^override 'max_agent_forks=4': need max_agent_forks >= attempts"):
        load_config(None, ["attempts=8", "max_agent_forks=4"], command="loop")
    with pytest.raises(UserError, match=r"^option --attempts: need max_agent_forks >= attempts"):
        load_config(None, ["max_agent_forks=4"], options={"attempts": 8}, command="loop")
    # Only the loop spreads max_agent_forks over attempts: sampling 1000 attempts alone is fine.
    assert load_config(None, ["attempts=1000"], command="sample")["attempts"] == 1000
    assert load_config(None, ["attempts=1000"])["attempts"] == 1000


def test_warm_start_needs_problems():
    with pytest.raises(UserError, match="warmup_sft_problems must be >= 1 when warmup_sft_steps > 0"):
        load_config(None, ["warmup_sft_steps=4", "warmup_sft_problems=0"])
    assert load_config(None, ["warmup_sft_steps=0", "warmup_sft_problems=0"])["warmup_sft_problems"] == 0  # unused: fine


def test_loop_kl_needs_a_reference_model():
    for key in ("finetune.rl.kl_coef", "finetune.rl.implicit_kl_coef"):
        with pytest.raises(UserError, match=rf"^override '{key}=0.1': {key} > 0 needs .*filter.ref_model"):
            load_config(None, ["filter.ref_model=null", f"{key}=0.1"], command="loop")
        load_config(None, [f"{key}=0.1", "filter.ref_model=smollm2-135m"], command="loop")
        load_config(None, ["filter.ref_model=null", f"{key}=0.1"], command="filter")  # filter --ref-model can supply it


# ---------------------------------------------------------------------------------------------
# Normalisation: what YAML and the command line type, made canonical


def test_values_are_normalised():
    cfg = load_config(None, ["finetune.learning_rate=1", "max_agent_forks=1e3", "report_to=tensorboard,wandb",
                             "finetune.compile=false", "transformers.static_cache='true'", "openai.api_key=12345",
                             "report_to=tensorboard"])
    assert cfg["finetune"]["learning_rate"] == 1.0 and isinstance(cfg["finetune"]["learning_rate"], float)
    assert cfg["max_agent_forks"] == 1000 and isinstance(cfg["max_agent_forks"], int)
    assert cfg["report_to"] == ["tensorboard"]
    assert cfg["finetune"]["compile"] is False
    assert cfg["transformers"]["static_cache"] is True  # a quoted "true": bool("false") would lie
    assert cfg["openai"]["api_key"] == "12345"
    assert load_config(None, ["report_to=tensorboard,wandb"])["report_to"] == ["tensorboard", "wandb"]
    assert load_config(None, ["report_to=null"])["report_to"] == []
    assert load_config(None, ["openai.base_url=http://a:1/v1,http://b:2"])["openai"]["base_url"] == \
        "http://a:1/v1,http://b:2"


def test_set_value_checks_the_key():
    cfg = load_config()
    set_value(cfg, "finetune.steps", 3)
    assert cfg["finetune"]["steps"] == 3
    with pytest.raises(UserError, match=re.escape("option --steps: finetune.steps must be >= 1 or null, got 0")):
        set_value(cfg, "finetune.steps", 0)
    with pytest.raises(UserError, match="option --objective: finetune.objective must be one of"):
        set_value(cfg, "finetune.objective", "ppo")
    with pytest.raises(UserError, match="unknown config key 'finetune.stpes'"):
        set_value(cfg, "finetune.stpes", 3)


def test_validate_a_library_dict():
    cfg = default_config()
    del cfg["sampling"]["top_p"]
    with pytest.raises(UserError, match="config: missing config key 'sampling.top_p'"):
        validate(cfg)
    cfg = default_config()
    cfg["sampling"]["top_k"] = 5
    msg = "^config: unknown config key 'sampling.top_k'; did you mean sampling.top_p"
    with pytest.raises(UserError, match=msg):
        validate(cfg)


def test_vllm_dtype_auto_is_float32_where_the_cpu_emulates_bfloat16(tmp_path):
    from gsm8kctl.sampling.backends.vllm import engine_dtype, native_bf16_cpu

    amx, avx, plain = tmp_path / "amx", tmp_path / "avx", tmp_path / "plain"
    amx.write_text("flags\t\t: fpu sse2 avx2 amx_bf16 amx_tile\n")
    avx.write_text("flags\t\t: fpu avx512f avx512_bf16\n")
    plain.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16x\n")  # a longer name is not the flag
    assert native_bf16_cpu(str(amx)) and native_bf16_cpu(str(avx))
    assert not native_bf16_cpu(str(plain)) and not native_bf16_cpu(str(tmp_path / "absent"))
    assert engine_dtype("float16") == "float16" and engine_dtype("bfloat16") == "bfloat16"
    import torch

    if not torch.cuda.is_available():
        assert engine_dtype("auto") == ("bfloat16" if native_bf16_cpu() else "float32")
    assert default_config()["vllm"]["dtype"] == "auto"

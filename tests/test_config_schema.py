"""The schema's words for pydantic's errors: one line per key, the same as before pydantic.

tests/test_config.py covers a row per key through the loader; these rows pin the full text of
the cases the translation has to work out: unions (null, a number or a word), list items, the
coercions, and the order in which one config's problems are reported.
"""

import pytest

from gsm8kctl.config import default_config, schema

REFUSED = [
    # (key, value, the whole problem)
    ("eval_limit", "x", "must be an integer >= 1 or null, got 'x'"),
    ("attempts", True, "must be an integer, got true"),
    ("attempts", "5", "must be an integer, got '5'"),
    ("attempts", 2.5, "must be an integer, got 2.5"),
    ("sampling.temperature", float("nan"), "must be a finite number, got nan"),
    ("warn_kl", float("inf"), "must be a finite number or null, got inf"),
    ("sampling.temperature", True, "must be a number, got true"),
    ("gpu_memory_share", "half", "must be a number in (0, 1] or one of auto, got 'half'"),
    ("gpu_memory_share", 2, "must be in (0, 1], got 2"),
    ("gpu_memory_share", None, "must be a number in (0, 1] or one of auto, got null"),
    ("finetune.objective", "grop", "must be one of sft, reinforce, grpo or null, got 'grop'"),
    ("finetune.lr_scheduler", "cosin", "must be one of constant, cosine, got 'cosin'; did you mean cosine?"),
    ("finetune.compile", 1, "must be one of auto, true, false, got 1"),
    ("finetune.compile", 1.0, "must be one of auto, true, false, got 1.0"),
    ("use_rejection_sampling", "yes", "must be true or false, got 'yes'"),
    ("report_to", ["tensorboard", "wandbb"],
     "items must be one of tensorboard, wandb, got 'wandbb'; did you mean wandb?"),
    ("report_to", 5, "must be a list of tensorboard, wandb, got 5"),
    ("openai.base_url", "http://a, ftp://b", "must be http:// or https:// URLs or null, got 'ftp://b'"),
    ("openai.base_url", ",", "must name at least one URL (or be null), got ','"),
    ("openai.base_url", [[1]], "items must be a string, got [1]"),
    ("openai.base_url", {"a": 1}, "must be a string or a list of strings or null, got {'a': 1}"),
    ("openai.base_url", ["http://a", 5], "must be http:// or https:// URLs or null, got '5'"),
    ("openai.api_key", True, "must be a string, got true"),
    ("agent.task_template", 5, "must contain {question} (where the problem goes), got 5"),
    ("agent.task_template", "{question}}",
     "may use only the placeholder {question}; write literal braces as {{ and }}, got '{question}}'"),
    ("filter.ref_model", " ", "must not be empty, got ' '"),
    ("agent.system_prompt", [1], "must be a string or null, got [1]"),
    ("seed", 2**31, "must be in [0, 2147483647], got 2147483648"),
    ("sampling.kv_memory_fraction", 0.96, "must be in (0, 0.95], got 0.96"),
    ("model", None, "must be a string, got null"),
]


@pytest.mark.parametrize("key, value, problem", REFUSED, ids=[f"{k}={v!r}" for k, v, _ in REFUSED])
def test_refused_value_in_words(key, value, problem):
    with pytest.raises(schema.Invalid) as info:
        schema.check_value(key, value)
    assert str(info.value) == problem


NORMALISED = [
    # (key, value as YAML or the command line gives it, the config's value)
    ("transformers.static_cache", " TRUE ", True),
    ("use_rejection_sampling", "False ", False),
    ("report_to", "tensorboard, wandb", ["tensorboard", "wandb"]),
    ("report_to", None, []),
    ("openai.api_key", 12345, "12345"),
    ("openai.api_key", 1.5, "1.5"),
    ("max_agent_forks", 1e3, 1000),
    ("finetune.learning_rate", 1, 1.0),
    ("gpu_memory_share", 1, 1.0),
    ("openai.base_url", "http://a,http://b", "http://a,http://b"),
]


@pytest.mark.parametrize("key, value, expected", NORMALISED, ids=[f"{k}={v!r}" for k, v, _ in NORMALISED])
def test_accepted_value_is_normalised(key, value, expected):
    got = schema.check_value(key, value)
    assert got == expected and type(got) is type(expected)


def test_problems_come_unknown_keys_first_then_in_yaml_order():
    cfg = default_config()
    cfg["zz"] = 1
    cfg["sampling"]["top_p"] = 0
    del cfg["attempts"]
    cfg["sampling"]["top_k"] = 3
    cfg["finetune"] = 2
    assert list(schema.check_config(cfg)) == [
        ("zz", schema.UNKNOWN), ("attempts", schema.MISSING), ("sampling.top_k", schema.UNKNOWN),
        ("sampling.top_p", "must be in (0, 1], got 0"), ("finetune", "must be a section (a mapping of keys)")]


def test_a_checked_config_is_normalised_in_place():
    cfg = default_config()
    sampling = cfg["sampling"]
    cfg["sampling"]["temperature"], cfg["report_to"] = 1, "wandb"
    assert list(schema.check_config(cfg)) == []
    assert cfg["sampling"] is sampling and sampling["temperature"] == 1.0 and cfg["report_to"] == ["wandb"]

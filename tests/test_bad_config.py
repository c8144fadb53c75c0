"""Bad config values, refused at load by every command: one table across the commands.

Every row runs the real CLI (tests/badinput.py) and asserts exit 2, one stderr line naming the
source (override, option or file) and the key, no traceback, nothing written. The config is
checked before any input is read or model loaded, so the rows' input files are placeholders and
a row costs the CLI's start-up only; the rows with `{tiny}` show that a real model would not
have been loaded either (before the schema, `agent.reward_extractor=bogus` failed with exit 1
after the model loaded, leaving three files behind).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from badinput import Case, run_case


def files(contents: dict[str, str | bytes]):
    def setup(tmp: Path) -> None:
        for name, data in contents.items():
            (tmp / name).write_bytes(data if isinstance(data, bytes) else data.encode())

    return setup


# Placeholders: the config is refused before these are read.
INPUTS = files({"tapes.jsonl": '{"id": "t0"}\n', "samples.jsonl": '{"id": "s0"}\n'})

SAMPLE = ["sample", "-o", "{tmp}/out/tapes.jsonl"]
EVALUATE = ["evaluate", "-o", "{tmp}/ev"]
FILTER = ["filter", "{tmp}/tapes.jsonl", "-o", "{tmp}/samples-out.jsonl"]
FINETUNE = ["finetune", "{tmp}/samples.jsonl", "-o", "{tmp}/run"]
LOOP = ["loop", "--run-dir", "{tmp}/run"]

CASES = [
    # --- sample: values out of range, then each kind of source
    Case("sample-attempts-minus-1", [*SAMPLE, "attempts=-1"], "override 'attempts=-1': attempts must be >= 1"),
    Case("sample-attempts-0", [*SAMPLE, "attempts=0"], "override 'attempts=0': attempts must be >= 1, got 0"),
    Case("sample-temperature-negative", [*SAMPLE, "sampling.temperature=-1"],
         "override 'sampling.temperature=-1': sampling.temperature must be >= 0"),
    Case("sample-top-p-0", [*SAMPLE, "sampling.top_p=0"], "sampling.top_p must be in (0, 1], got 0"),
    Case("sample-max-tokens-option-0", [*SAMPLE, "--max-tokens", "0"],
         "option --max-tokens: sampling.max_tokens must be >= 1, got 0"),
    Case("sample-reward-extractor-bogus", [*SAMPLE, "--model", "{tiny}", "--backend", "transformers",
                                           "agent.reward_extractor=bogus"],
         "agent.reward_extractor must be one of strict, lenient, got 'bogus'"),
    Case("sample-attempts-option-0", [*SAMPLE, "--attempts", "0"], "option --attempts: attempts must be >= 1"),
    Case("sample-seed-option", [*SAMPLE, "--seed", "-1"], "option --seed: seed must be in [0, "),
    Case("sample-backend-option", [*SAMPLE, "--backend", "tensorrt"],
         "option --backend: backend must be one of auto, transformers, vllm, openai"),
    Case("sample-base-url-option", [*SAMPLE, "--backend", "openai", "--base-url", "localhost:8000"],
         "option --base-url: openai.base_url must be http:// or https:// URLs"),
    Case("sample-template-without-question", [*SAMPLE, "agent.task_template=Solve it."],
         "agent.task_template must contain {{question}}"),  # {{ }}: the harness formats expect
    Case("sample-config-file", [*SAMPLE, "--config", "{tmp}/bad.yaml"],
         "{tmp}/bad.yaml: sampling.top_p must be in (0, 1], got 0",
         files({"bad.yaml": "sampling:\n  top_p: 0\n"})),
    Case("sample-config-not-utf8", [*SAMPLE, "--config", "{tmp}/bad.yaml"],
         "{tmp}/bad.yaml:2: not UTF-8 (byte 0xff at offset 8)", files({"bad.yaml": b"seed: 1\n\xff\xfe: 2\n"})),
    Case("sample-config-duplicate-key", [*SAMPLE, "--config", "{tmp}/dup.yaml"],
         "{tmp}/dup.yaml:3: duplicate key 'max_tokens' (first on line 2)",
         files({"dup.yaml": "sampling:\n  max_tokens: 8\n  max_tokens: 16\n"})),
    # A typed option wins over the override, but the override is still checked.
    Case("sample-bad-override-under-option", [*SAMPLE, "--max-tokens", "4", "sampling.max_tokens=abc"],
         "override 'sampling.max_tokens=abc': sampling.max_tokens must be an integer, got 'abc'"),
    # --- evaluate
    Case("evaluate-max-tokens-option-0", [*EVALUATE, "--max-tokens", "0"],
         "option --max-tokens: evaluation.max_tokens must be >= 1"),
    Case("evaluate-config-not-utf8", [*EVALUATE, "--config", "{tmp}/bad.yaml"], "{tmp}/bad.yaml:1: not UTF-8",
         files({"bad.yaml": "model: caf\xe9\n".encode("latin-1")})),
    Case("evaluate-eval-limit-0", [*EVALUATE, "eval_limit=0"], "eval_limit must be >= 1 or null, got 0"),
    Case("sample-native-without-slots", [*SAMPLE, "transformers.model_code=native", "transformers.static_cache=false"],
         "transformers.model_code=native runs under the slot engine only, got transformers.static_cache=false"),
    Case("evaluate-static-cache", [*EVALUATE, "transformers.static_cache=maybe"],
         "transformers.static_cache must be one of auto, true, false, got 'maybe'"),
    Case("evaluate-split-k-attention-on-cpu", [*EVALUATE, "--model", "{tiny}", "--backend", "transformers",
                                               "transformers.decode_attention=split_k"],
         "transformers.decode_attention=split_k needs CUDA (this run is on the cpu); use auto or sdpa"),
    # --- filter
    Case("filter-kl-estimator", [*FILTER, "finetune.rl.implicit_kl_estimator=k2"],
         "finetune.rl.implicit_kl_estimator must be one of k1, k3, got 'k2'", INPUTS),
    Case("filter-max-per-problem-0", [*FILTER, "filter.max_per_problem=0"],
         "filter.max_per_problem must be >= 1 or null", INPUTS),
    # --- finetune
    Case("finetune-lr-scheduler-typo", [*FINETUNE, "--init", "{tiny}", "finetune.lr_scheduler=cosin"],
         "override 'finetune.lr_scheduler=cosin': finetune.lr_scheduler must be one of constant, cosine, "
         "got 'cosin'; did you mean cosine?", INPUTS),
    Case("finetune-steps-option-0", [*FINETUNE, "--steps", "0"], "option --steps: finetune.steps must be >= 1",
         INPUTS),
    Case("finetune-num-processes-option-0", [*FINETUNE, "--num-processes", "0"],
         "option --num-processes: finetune.num_processes must be >= 1", INPUTS),
    Case("finetune-learning-rate-0", [*FINETUNE, "finetune.learning_rate=0"],
         "finetune.learning_rate must be > 0, got 0", INPUTS),
    # --- loop: refused before the run directory exists
    Case("loop-lr-scheduler-typo", [*LOOP, "finetune.lr_scheduler=cosin"],
         "override 'finetune.lr_scheduler=cosin': finetune.lr_scheduler must be one of constant, cosine"),
    Case("loop-attempts-option-0", [*LOOP, "--attempts", "0"], "option --attempts: attempts must be >= 1"),
    Case("loop-iterations-option", [*LOOP, "--iterations", "-1"], "option --iterations: iterations must be >= 0"),
    Case("loop-forks-below-attempts", [*LOOP, "--attempts", "1000"],
         "option --attempts: need max_agent_forks >= attempts"),
    Case("loop-kl-without-reference", [*LOOP, "filter.ref_model=null", "finetune.rl.kl_coef=0.1"],
         "override 'finetune.rl.kl_coef=0.1': finetune.rl.kl_coef > 0 needs ref_logprobs"),
    Case("loop-warm-start-without-problems", [*LOOP, "warmup_sft_steps=4", "warmup_sft_problems=0"],
         "override 'warmup_sft_problems=0': warmup_sft_problems must be >= 1 when warmup_sft_steps > 0"),
    Case("loop-report-to", [*LOOP, "report_to=tensorboard,mlflow"],
         "report_to items must be one of tensorboard, wandb, got 'mlflow'"),
    Case("loop-config-file", [*LOOP, "--config", "{tmp}/bad.yaml"],
         "{tmp}/bad.yaml: finetune.rl.algo must be one of reinforce, grpo, got 'ppo'",
         files({"bad.yaml": "finetune:\n  rl:\n    algo: ppo\n"})),
    Case("loop-config-duplicate-section", [*LOOP, "--config", "{tmp}/dup.yaml"],
         "{tmp}/dup.yaml:4: duplicate key 'sampling' (first on line 1)",
         files({"dup.yaml": "sampling:\n  top_p: 0.5\nseed: 3\nsampling:\n  max_tokens: 8\n"})),
    Case("loop-bad-override-under-option", [*LOOP, "--attempts", "4", "attempts=four"],
         "override 'attempts=four': attempts must be an integer, got 'four'"),
    # --- stats reads no config: a key=value argument is a path, and says so
    Case("stats-takes-no-config", ["stats", "attempts=0"], "attempts=0"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_config_is_refused(case, tmp_path, request):
    run_case(case, tmp_path, request)


def test_the_table_is_wide():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 25
    assert {c.args[0] for c in CASES} >= {"sample", "evaluate", "filter", "finetune", "loop", "stats"}

"""`sample`, `evaluate`, `stats` through the real entry point on a tiny random-init model."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from conftest import REPO, run_cli
from gsm8kctl.artifacts.jsonl import read_jsonl
from gsm8kctl.artifacts.llm_calls import open_readonly

TAPE_KEYS = {"id", "iteration", "split", "problem_id", "attempt", "model", "question", "gold", "steps",
             "answer", "correct", "reward", "finish_reason", "prompt_token_ids", "completion_token_ids",
             "logprobs", "created"}


def _sample(model, out, *extra):
    return run_cli("sample", "--model", model, "--backend", "transformers", "-o", str(out), "--max-tokens", "8",
                   *extra)


def test_sample_writes_tapes_calls_and_config(tiny_model_dir, tmp_path):
    out = tmp_path / "run" / "tapes.jsonl"
    proc = _sample(tiny_model_dir, out, "--n-problems", "3", "--attempts", "2", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    tapes = list(read_jsonl(out))
    assert len(tapes) == 6
    assert TAPE_KEYS <= set(tapes[0])
    assert Counter(t["problem_id"] for t in tapes) == {"train-00000": 2, "train-00001": 2, "train-00002": 2}
    assert {t["attempt"] for t in tapes} == {0, 1}
    t = tapes[0]
    assert len(t["logprobs"]) == len(t["completion_token_ids"]) == 8 and t["finish_reason"] == "length"
    assert t["reward"] == -1.0  # cut at max tokens
    # Token-exact: the prompt ids are the chat template rendering of the agent's messages.
    from transformers import AutoTokenizer

    from gsm8kctl.agent import build_messages
    from gsm8kctl.artifacts.chat import render_prompt

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert render_prompt(tok, build_messages(t["question"]))[1] == t["prompt_token_ids"]
    conn = open_readonly(out.parent / "llm_calls.sqlite")
    assert conn.execute("SELECT count(*) FROM llm_calls").fetchone()[0] == 6
    call = conn.execute("SELECT * FROM llm_calls WHERE tape_id = ?", (t["id"],)).fetchone()
    assert call["completion_tokens"] == 8 and json.loads(call["prompt"])[-1]["role"] == "user"
    assert t["steps"][1]["llm_call_id"] == call["id"]
    assert (out.parent / "tapes.config.yaml").exists()


def test_rerun_appends_only_missing(tiny_model_dir, tmp_path):
    out = tmp_path / "tapes.jsonl"
    assert _sample(tiny_model_dir, out, "--n-problems", "2", "--attempts", "2").returncode == 0
    proc = _sample(tiny_model_dir, out, "--n-problems", "3", "--attempts", "3")
    assert proc.returncode == 0, proc.stderr
    keys = [(t["problem_id"], t["attempt"]) for t in read_jsonl(out)]
    assert len(keys) == len(set(keys)) == 9
    assert _sample(tiny_model_dir, out, "--n-problems", "3", "--attempts", "3").returncode == 0
    assert len(list(read_jsonl(out))) == 9


def test_sigkill_then_resume_no_duplicates_no_losses(tiny_model_dir, tmp_path):
    out = tmp_path / "tapes.jsonl"
    cmd = [sys.executable, "-m", "gsm8kctl", "sample", "--model", tiny_model_dir, "--backend", "transformers",
           "-o", str(out), "--n-problems", "24", "--attempts", "2", "--max-tokens", "16", "-q",
           "sampling.batch_size=1", "transformers.dtype=float32", "sampling.write_interval_s=0"]
    # Each attempt is written as it finishes (write_interval_s=0): at the default 1 s, an idle
    # machine finished all 48 inside the first interval, and the kill came too late (seen in CI).
    proc = subprocess.Popen(cmd, cwd=REPO, env=os.environ.copy(), stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline:
        if out.exists() and sum(1 for _ in open(out)) >= 6:
            break
        if proc.poll() is not None:
            pytest.fail(f"sample ended before it could be killed: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = list(read_jsonl(out))  # every line parses
    assert 6 <= len(written) < 48
    resumed = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    keys = [(t["problem_id"], t["attempt"]) for t in read_jsonl(out)]
    assert len(keys) == 48 and len(set(keys)) == 48
    conn = open_readonly(tmp_path / "llm_calls.sqlite")
    assert conn.execute("SELECT count(*) FROM llm_calls").fetchone()[0] == 48
    assert conn.execute("SELECT count(DISTINCT tape_id) FROM llm_calls").fetchone()[0] == 48
    # Bit-identical to a run never killed: each attempt's seed comes from its tape id, not from
    # its place in the calls after the restart. Rows are decoded one at a time in float32, so the
    # logits do not depend on which rows share a batch: a batch's padding width changes the
    # order of the attention sums, and a near-tie then flips (seen once in CI with batch 2).
    whole = tmp_path / "whole" / "tapes.jsonl"
    assert subprocess.run([*cmd[:cmd.index("-o") + 1], str(whole), *cmd[cmd.index("-o") + 2:]], cwd=REPO,
                          capture_output=True, timeout=600).returncode == 0
    tokens = {t["id"]: t["completion_token_ids"] for t in read_jsonl(out)}
    assert tokens == {t["id"]: t["completion_token_ids"] for t in read_jsonl(whole)}


def test_pipeline_stdout_into_stats(tiny_model_dir):
    proc = run_cli("sample", "--model", tiny_model_dir, "--backend", "transformers", "-o", "-", "-q",
                   "--n-problems", "2", "--attempts", "2", "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 4
    stats = run_cli("stats", "--json", "-", input=proc.stdout)
    assert stats.returncode == 0, stats.stderr
    result = json.loads(stats.stdout)
    assert result["count"] == 4 and result["problems"] == 2 and result["overflow_rate"] == 1.0
    assert set(result["pass_at_k"]) == {"1", "2"}


def test_evaluate_writes_metrics(tiny_model_dir, tmp_path):
    proc = run_cli("evaluate", "--model", tiny_model_dir, "--backend", "transformers", "-o", str(tmp_path / "ev"),
                   "--limit", "3", "--max-tokens", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads(proc.stdout)
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text()) == metrics
    assert {"n", "accuracy_strict", "accuracy_lenient", "format_rate", "overflow_rate", "mean_output_tokens",
            "model", "backend"} <= set(metrics)
    assert metrics["n"] == 3 and metrics["backend"] == "transformers" and metrics["mean_output_tokens"] == 6
    tapes = list(read_jsonl(tmp_path / "ev" / "tapes.jsonl"))
    assert [t["split"] for t in tapes] == ["test"] * 3
    assert (tmp_path / "ev" / "config.yaml").exists()


@pytest.mark.parametrize("args, message", [
    (["stats", "/nonexistent/tapes.jsonl"], "/nonexistent/tapes.jsonl: no such file"),
    (["sample", "-o", "{tmp}/t.jsonl", "--model", "/nonexistent/model"], "unknown model"),
    (["sample", "-o", "{tmp}/t.jsonl", "--backend", "tensorrt"], "backend must be one of auto, transformers, vllm, openai, got 'tensorrt'"),
    (["sample", "-o", "{tmp}/t.jsonl", "finetune.learnig_rate=1"], "did you mean finetune.learning_rate"),
    (["sample", "-o", "{tmp}/t.jsonl", "--problem-ids", "train-99999"], "unknown problem id"),
    (["sample", "-o", "{tmp}/t.jsonl", "--n-problems", "0"], "--n-problems must be positive"),
    (["evaluate", "-o", "{tmp}/ev", "--data-dir", "{tmp}/nodata"], "no such file"),
])
def test_bad_input_one_line_exit_2(args, message, tmp_path):
    proc = run_cli(*[a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_malformed_tapes_file_names_line(tmp_path):
    p = tmp_path / "tapes.jsonl"
    p.write_text('{"id": "a"}\nnot json\n')
    proc = run_cli("stats", str(p))
    assert proc.returncode == 2 and f"{p}:2: invalid JSON" in proc.stderr


def test_help_lists_only_working_commands():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for name in ("sample", "evaluate", "stats"):
        assert name in proc.stdout

"""The real embedded SmolLM2-135M-Instruct through the CLI (transformers backend, CPU)."""

import json

import pytest

from conftest import run_cli
from gsm8kctl.artifacts.jsonl import read_jsonl

pytestmark = pytest.mark.slow


def test_embedded_model_converts_with_fixed_eos(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    assert AutoConfig.from_pretrained(smollm2_dir).num_hidden_layers == 30
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                             add_generation_prompt=True)


def test_first_conversion_says_one_line_and_shows_no_progress_bars(tmp_path):
    """A fresh cache converts the embedded GGUF: the user reads our one line, not the progress bars
    of transformers' conversion, loading and writing (those show with GSM8KCTL_DEBUG=1). Two
    processes converting at once (two test workers, two loops) both succeed on one copy."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "GSM8KCTL_CACHE": str(tmp_path / "cache")}
    env.pop("GSM8KCTL_DEBUG", None)
    code = "from gsm8kctl.artifacts.models import resolve_model; print(resolve_model('smollm2-135m'))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    target = tmp_path / "cache" / "models" / "smollm2-135m"
    said = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        assert out.strip() == str(target)
        lines = [line for line in err.splitlines() if line.strip()]
        # One line each, or none from a process that started after the other had finished.
        assert len(lines) <= 1 and all(x.startswith("converting the embedded model smollm2-135m") for x in lines), err
        said += lines
    assert said
    assert (target / "model.safetensors").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == ["smollm2-135m"]  # no half copy left
    # Converted once: a second call finds it and says nothing.
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stderr.strip() == "", again.stderr


def test_evaluate_limit_4_on_real_model(smollm2_dir, tmp_path):
    proc = run_cli("evaluate", "--model", "smollm2-135m", "--backend", "transformers", "--limit", "4",
                   "--max-tokens", "96", "-o", str(tmp_path / "ev"), "--json")
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout)
    assert m["n"] == 4 and m["model"] == "smollm2-135m" and 0 <= m["accuracy_lenient"] <= 1
    tapes = list(read_jsonl(tmp_path / "ev" / "tapes.jsonl"))
    # A real model writes English and, given room, ends its turn: its text decodes cleanly.
    assert all(t["steps"][1]["text"].strip() for t in tapes)
    assert all(len(t["completion_token_ids"]) <= 96 for t in tapes)


def test_sample_2_problems_x_2_attempts_on_real_model(smollm2_dir, tmp_path):
    out = tmp_path / "tapes.jsonl"
    proc = run_cli("sample", "--model", "smollm2-135m", "--backend", "transformers", "--n-problems", "2",
                   "--attempts", "2", "--max-tokens", "256", "--seed", "3", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    tapes = list(read_jsonl(out))
    assert len(tapes) == 4
    stopped = [t for t in tapes if t["finish_reason"] == "stop"]
    for t in stopped:  # the stop token is kept in the ids so training teaches the model to stop
        assert t["completion_token_ids"][-1] == 2  # <|im_end|> in the SmolLM2 vocabulary
    assert all(len(t["logprobs"]) == len(t["completion_token_ids"]) for t in tapes)
    assert all(lp <= 0 for t in tapes for lp in t["logprobs"])

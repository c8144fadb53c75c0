"""Our Llama-family decoder (backends/llama.py) against transformers' modules, float32 on the CPU.

It stands in for the Hugging Face module under the slot engine, so its numbers must be that
module's: logits on the same weights, then sampled tokens and log-probs through the engine.
And a sampling process that runs it must not import transformers at all (the point of it).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gsm8kctl.config import load_config
from gsm8kctl.errors import UserError
from gsm8kctl.sampling.backends import llama
from gsm8kctl.sampling.backends.base import SamplingParams
from gsm8kctl.sampling.backends.transformers import TransformersBackend, use_native
from tests.conftest import run_cli


def _random_model(kind: str, tiny_model_dir: str, out) -> str:
    """A tiny random model of `kind` with every bias non-zero (transformers initialises them to zero)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, MistralConfig, Qwen2Config

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    common = dict(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = (Qwen2Config(**common, tie_word_embeddings=False) if kind == "qwen2"
              else MistralConfig(**common, sliding_window=None, tie_word_embeddings=False))
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _hf(path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _rows():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(100, 20000, (3, 21), generator=g)
    return ids, torch.arange(21).expand(3, 21)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_logits_are_transformers_logits(kind, tiny_model_dir, tmp_path):
    path = tiny_model_dir if kind == "llama" else _random_model(kind, tiny_model_dir, tmp_path / kind)
    hf, ours = _hf(path), llama.load(path, device="cpu", dtype=torch.float32)
    assert set(ours.state_dict()) == set(hf.state_dict())
    if kind == "qwen2":
        assert ours.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0  # the biases are really there
    ids, positions = _rows()
    with torch.inference_mode():
        want = hf(input_ids=ids, position_ids=positions).logits
        got = ours(input_ids=ids, position_ids=positions).logits
    assert got.shape == want.shape and torch.equal(got, want)  # op for op: the same bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_smollm2_logits_bit_for_bit(smollm2_dir, dtype):
    hf, ours = _hf(smollm2_dir, dtype), llama.load(smollm2_dir, device="cpu", dtype=dtype)
    ids, positions = _rows()
    with torch.inference_mode():
        assert torch.equal(ours(input_ids=ids, position_ids=positions).logits,
                           hf(input_ids=ids, position_ids=positions).logits)


def test_slot_engine_samples_the_same_with_either_module(tiny_model_dir):
    """Through the slot engine (its attention for both), seeded T=1 and greedy: the same tokens
    and log-probs from our decoder as from the Hugging Face module."""
    def backend(code):
        cfg = load_config(None, ["transformers.static_cache=true", "sampling.max_slots=5",
                                 f"transformers.model_code={code}"])
        return TransformersBackend(tiny_model_dir, cfg, dtype="float32")

    ours, hf = backend("native"), backend("hf")
    assert isinstance(ours.model_obj, llama.CausalLM) and not isinstance(hf.model_obj, llama.CausalLM)
    assert type(ours.tokenizer).__name__ == "ChatTokenizer"
    prompts = [[5 + i * 7 % 300 for i in range(n)] for n in (4, 19, 33, 8)]
    for temperature in (1.0, 0.0):
        params = SamplingParams(n=3, temperature=temperature, top_p=1.0, max_tokens=20, seed=11)
        a, b = ours.generate(prompts, params), hf.generate(prompts, params)
        assert [[c.token_ids for c in r] for r in a] == [[c.token_ids for c in r] for r in b]
        diff = max(abs(x - y) for ra, rb in zip(a, b) for ca, cb in zip(ra, rb)
                   for x, y in zip(ca.logprobs, cb.logprobs))
        assert diff < 1e-5
    # score() on our decoder: one causal pass per row, as on CUDA.
    comps = [c.token_ids for r in a for c in r]
    rows = [p for p in prompts for _ in range(3)]
    for x, y in zip(ours.score(rows, comps), hf.score(rows, comps)):
        assert max(abs(u - v) for u, v in zip(x, y)) < 1e-4


def test_what_it_cannot_run_goes_to_transformers_or_is_refused(tiny_model_dir, tmp_path):
    path = tmp_path / "llama3-rope"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    (path / "config.json").write_text(json.dumps(config))
    # auto: our decoder on CUDA under the slot engine where it runs the model; else transformers'.
    assert use_native("auto", device="cuda", static_cache=True, model="m", unsupported=None)
    for device, static, reason in (("cuda", True, "RoPE type 'llama3'"), ("cuda", False, None), ("cpu", True, None)):
        assert not use_native("auto", device=device, static_cache=static, model="m", unsupported=reason)
    auto = TransformersBackend(str(path), load_config(None, ["transformers.static_cache=true"]), dtype="float32")
    assert not auto.native and not isinstance(auto.model_obj, llama.CausalLM)
    with pytest.raises(UserError, match="model_code=native cannot run this model: RoPE type 'llama3'"):
        TransformersBackend(str(path), load_config(None, ["transformers.static_cache=true",
                                                          "transformers.model_code=native"]))
    with pytest.raises(UserError, match="runs under the slot engine only"):  # static_cache auto, on the CPU
        TransformersBackend(tiny_model_dir, load_config(None, ["transformers.model_code=native"]))
    # The CPU's default (dynamic cache) keeps the Hugging Face module.
    assert not TransformersBackend(tiny_model_dir, load_config(None, []), dtype="float32").native


def test_a_sample_process_on_our_decoder_imports_no_transformers(tiny_model_dir, tmp_path):
    out = tmp_path / "t.jsonl"
    proc = run_cli("sample", "--model", tiny_model_dir, "--backend", "transformers", "-o", str(out),
                   "--max-tokens", "6", "--n-problems", "2", "--attempts", "2", "transformers.static_cache=true",
                   "transformers.model_code=native", "-v",  # -v: the interpreter's import profile on stderr
                   env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(out.read_text().splitlines()) == 4
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" in imported and "tokenizers" in imported  # the profile is real
    assert not {m for m in imported if m.split(".")[0] == "transformers"}


def test_native_on_a_model_it_cannot_run_is_one_line_and_writes_nothing(tiny_model_dir, tmp_path):
    path = tmp_path / "gelu"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    out = tmp_path / "run" / "t.jsonl"
    proc = run_cli("sample", "--model", str(path), "--backend", "transformers", "-o", str(out), "--max-tokens", "4",
                   "--n-problems", "1", "transformers.static_cache=true", "transformers.model_code=native")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"Error: {path}: transformers.model_code=native cannot run this model: "
                                   "hidden_act 'gelu'; use auto or hf")
    assert not out.parent.exists()

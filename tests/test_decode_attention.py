"""The split-K decode attention kernel (backends/decode_attention.py), run by Triton's interpreter
on the CPU: what the kernel computes is checked here, its speed on the GPU (docs/benchmarks.md).

The interpreter is chosen when Triton is first imported, so each check runs in a child process
with TRITON_INTERPRET=1 (the rest of the suite must not see it: vLLM imports Triton too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

KERNEL_CHECK = textwrap.dedent("""
    import json, sys, torch
    from gsm8kctl.sampling.backends.decode_attention import CHUNK, DecodeAttention
    def check(slots, max_len, kv_heads, rep, dim, dtype):
        dtype = getattr(torch, dtype)
        torch.manual_seed(0)
        k = torch.full((slots, max_len, kv_heads, dim), float("nan"))
        v = torch.full((slots, max_len, kv_heads, dim), float("nan"))
        # Keys used by each row, across split edges; the rest of each slot stays NaN: never read.
        n = torch.tensor([1, CHUNK - 1, CHUNK, CHUNK + 1, max_len][:slots - 1], dtype=torch.int32)
        b = len(n)  # one slot row less than the cache holds: a bucket below the slot count
        for row, used in enumerate(n.tolist()):
            k[row, :used] = torch.randn(used, kv_heads, dim)
            v[row, :used] = torch.randn(used, kv_heads, dim)
        q = torch.randn(b, kv_heads, rep, dim)
        k, v, q = k.to(dtype), v.to(dtype), q.to(dtype)
        out = DecodeAttention(slots, max_len, kv_heads, rep, dim, dtype, "cpu")(q, k, v, n, dim ** -0.5)
        err = 0.0
        for row, used in enumerate(n.tolist()):
            kk, vv = k[row, :used].float().transpose(0, 1), v[row, :used].float().transpose(0, 1)
            ref = torch.softmax(q[row].float() @ kk.transpose(1, 2) * dim ** -0.5, -1) @ vv
            err = max(err, (out[row].float() - ref).abs().max().item())
        return {"shape": list(out.shape), "dtype": str(out.dtype), "err": err}
    print(json.dumps({json.dumps(shape): check(*shape) for shape in json.loads(sys.argv[1])}))
""")

ENGINE_CHECK = textwrap.dedent("""
    import json, random, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from gsm8kctl.sampling.backends.slots import Request, SlotEngine
    torch.manual_seed(0)
    # head_dim 16 (the kernel's smallest), 6 query heads on 2 kv heads; slots longer than a split.
    cfg = LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(250, 300))] for _ in range(5)]
    out = {}
    for attention in ("sdpa", "split_k"):
        engine = SlotEngine(model, slots=3, max_len=320, stop_ids=[0], pad_id=0, attention=attention)
        reqs = [Request(i, p, seed=i) for i, p in enumerate(prompts)]
        done = {f.index: (f.token_ids, f.logprobs) for f in engine.run(reqs, temperature=0.0, top_p=1.0,
                                                                         max_tokens=12)}
        out[attention] = [done[i] for i in range(len(prompts))]
    lp_err = max(abs(a - b) for (_, x), (_, y) in zip(out["sdpa"], out["split_k"]) for a, b in zip(x, y))
    print(json.dumps({"same_tokens": [t for t, _ in out["sdpa"]] == [t for t, _ in out["split_k"]],
                      "lp_err": lp_err, "n": sum(len(t) for t, _ in out["split_k"])}))
""")


def _child(code: str, *args: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          cwd=str(REPO), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


SHAPES = [
    # SmolLM2-135M: 9 query heads on 3 kv heads, head_dim 64
    ((6, 600, 3, 3, 64, "float32"), 1e-5),
    ((6, 600, 3, 3, 64, "float16"), 2e-3),
    # Qwen2.5-1.5B: 12 on 2, head_dim 128
    ((4, 520, 2, 6, 128, "float32"), 1e-5),
]


@pytest.fixture(scope="module")
def kernel_results() -> dict:
    """Every shape in one child: one torch import instead of one per shape."""
    return _child(KERNEL_CHECK, json.dumps([list(shape) for shape, _ in SHAPES]))


@pytest.mark.parametrize("shape,tolerance", SHAPES)
def test_kernel_is_softmax_attention_over_each_slots_own_keys(kernel_results, shape, tolerance):
    """Rows of 1 key, one short of a split, exactly a split, one over, and a full slot; the cache
    past each row's keys is NaN, so a read past them would show."""
    got = kernel_results[json.dumps(list(shape))]
    slots, _, kv_heads, rep, dim, dtype = shape
    assert got["shape"] == [slots - 1, kv_heads, rep, dim] and got["dtype"] == f"torch.{dtype}"
    assert got["err"] < tolerance


def test_slot_engine_with_split_k_gives_the_same_tokens():
    """Greedy decoding through the slot engine (refills, prompts across a split edge): the
    kernel's tokens equal masked SDPA's, and their log-probs agree."""
    got = _child(ENGINE_CHECK)
    assert got["n"] == 5 * 12
    assert got["same_tokens"]
    assert got["lp_err"] < 1e-4


def test_the_backend_refuses_cuda_kernels_off_cuda_before_loading(tmp_path):
    """The transformers backend opened directly (as the in-process engine and scripts do), not
    through a stage: split_k and flash on the CPU fail in one line, before any file is read."""
    from gsm8kctl.config import default_config, set_value
    from gsm8kctl.errors import UserError
    from gsm8kctl.sampling.backends import get_backend

    for attention in ("split_k", "flash"):
        cfg = default_config()
        set_value(cfg, "transformers.decode_attention", attention)
        with pytest.raises(UserError, match=f"decode_attention={attention} needs CUDA .*on the cpu"):
            get_backend("transformers", str(tmp_path / "no-model-here"), cfg)  # not read: refused first

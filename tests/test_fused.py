"""The fused kernels of our decoder (backends/fused.py), run by Triton's interpreter on the CPU.

As in test_decode_attention.py, each check runs in a child process with TRITON_INTERPRET=1.
The kernels stand in for eager ops, so each is compared with those ops on the same inputs, then
the whole fused forward with the eager one, and the slot engine's tokens on either.
"""

from __future__ import annotations

import textwrap

import pytest

from test_decode_attention import _child

OPS_CHECK = textwrap.dedent("""
    import json, torch
    import torch.nn.functional as F
    from gsm8kctl.sampling.backends import fused
    from gsm8kctl.sampling.backends.llama import _rotate_half
    torch.manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.float16):
        x, r = torch.randn(5, 3, 96, dtype=dtype), torch.randn(5, 3, 96, dtype=dtype)
        w = torch.randn(96, dtype=dtype)
        h = r + x
        h32 = h.float()
        want = w * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        normed, summed = fused.add_rmsnorm(x, r, w, 1e-5)
        first, same = fused.add_rmsnorm(x, None, w, 1e-5)
        x32 = x.float()
        want_first = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        # RoPE over a fused [q; k; v] row: 6 query heads, 2 key heads, head size 80 (half 40: masked).
        heads, kv, d = 6, 2, 80
        qkv = torch.randn(2, 7, (heads + 2 * kv) * d, dtype=dtype)
        ang = torch.randn(2, 7, d // 2)
        cos, sin = torch.cat((ang, ang), -1).cos().to(dtype), torch.cat((ang, ang), -1).sin().to(dtype)
        q, k = fused.rope(qkv, cos, sin, heads, kv, d)
        def eager(t, n):
            t = t.view(2, 7, n, d).transpose(1, 2)
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            return ((t * c) + (_rotate_half(t) * s)).transpose(1, 2)
        gu = torch.randn(4, 2, 2 * 1536, dtype=dtype)
        act = fused.silu_mul(gu)
        out[str(dtype)] = {
            "sum_exact": torch.equal(summed, h), "x_kept": torch.equal(same, x) and same.data_ptr() == x.data_ptr(),
            "norm_err": (normed.float() - want.float()).abs().max().item(),
            "first_err": (first.float() - want_first.float()).abs().max().item(),
            "q_exact": torch.equal(q, eager(qkv[..., :heads * d], heads)),
            "k_exact": torch.equal(k, eager(qkv[..., heads * d:(heads + kv) * d], kv)),
            "silu_err": (act.float() - (F.silu(gu[..., :1536]) * gu[..., 1536:]).float()).abs().max().item(),
            "shapes": [list(normed.shape), list(q.shape), list(k.shape), list(act.shape)]}
    print(json.dumps(out))
""")

MODEL_CHECK = textwrap.dedent("""
    import json, sys, torch
    from gsm8kctl.sampling.backends import llama
    from gsm8kctl.sampling.backends.slots import Request, SlotEngine
    path = sys.argv[1]
    out = {}
    for dtype in (torch.float32, torch.float16):
        eager = llama.load(path, device="cpu", dtype=dtype, fuse_kernels=False)
        fused = llama.load(path, device="cpu", dtype=dtype, fuse_kernels=True)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(100, 20000, (3, 9), generator=g)
        pos = torch.arange(9).expand(3, 9)
        with torch.inference_mode():
            a = eager(input_ids=ids, position_ids=pos).logits.float()
            b = fused(input_ids=ids, position_ids=pos).logits.float()
        out[str(dtype)] = {"err": (a - b).abs().max().item(), "fused": fused.model.fused and not eager.model.fused,
                           "keys": sorted(eager.state_dict()) == sorted(fused.state_dict())}
    # A state_dict write reaches the fused matrix (the loop refreshes its sampler this way).
    sd = fused.state_dict()
    sd["model.layers.0.self_attn.k_proj.weight"].fill_(0.5)
    qkv = fused.model.layers[0].self_attn.qkv_weight
    heads, kv, d = fused.config.num_attention_heads, fused.config.num_key_value_heads, fused.config.head_dim
    out["refresh"] = bool((qkv[heads * d:(heads + kv) * d] == 0.5).all()) and not bool((qkv[:heads * d] == 0.5).any())
    # The slot engine, greedy float32: the same tokens on the fused forward as on the eager one.
    tokens = {}
    for name, fuse in (("eager", False), ("fused", True)):
        model = llama.load(path, device="cpu", dtype=torch.float32, fuse_kernels=fuse)
        engine = SlotEngine(model, slots=3, max_len=96, stop_ids=[0], pad_id=0)
        reqs = [Request(i, [7 + 13 * j % 500 for j in range(5 + 9 * i)], seed=i) for i in range(5)]
        done = {f.index: f.token_ids for f in engine.run(reqs, temperature=0.0, top_p=1.0, max_tokens=10)}
        tokens[name] = [done[i] for i in range(5)]
    out["engine_same"] = tokens["eager"] == tokens["fused"]
    out["engine_n"] = sum(map(len, tokens["fused"]))
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def ops() -> dict:
    return _child(OPS_CHECK)


@pytest.mark.parametrize("dtype,tolerance", [("torch.float32", 1e-5), ("torch.float16", 4e-3)])
def test_kernels_compute_the_eager_ops(ops, dtype, tolerance):
    """The residual sum and RoPE bit for bit (each op rounded as the eager op rounds it); the
    norm and SiLU-mul to rounding (their float32 sums and exp are Triton's)."""
    got = ops[dtype]
    assert got["sum_exact"] and got["x_kept"]
    assert got["q_exact"] and got["k_exact"]
    assert got["norm_err"] < tolerance * 4 and got["first_err"] < tolerance * 4
    assert got["silu_err"] < tolerance
    assert got["shapes"] == [[5, 3, 96], [2, 7, 6, 80], [2, 7, 2, 80], [4, 2, 1536]]


def test_fused_forward_equals_eager_forward_and_engine_tokens(tiny_model_dir):
    got = _child(MODEL_CHECK, tiny_model_dir)
    assert got["torch.float32"]["fused"] and got["torch.float32"]["keys"]
    assert got["torch.float32"]["err"] < 1e-5
    assert got["torch.float16"]["err"] < 5e-3
    assert got["refresh"]
    assert got["engine_n"] == 50 and got["engine_same"]

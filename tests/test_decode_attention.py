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

# A random-init Llama for the engine checks: head_dim 16 (the kernel's smallest), 6 query heads
# on 2 kv heads.
TINY_LLAMA = textwrap.dedent("""
    import json, random, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from gsm8kctl.sampling.backends.slots import Request, SlotEngine
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).eval()
""")

PREFIX_CHECK = textwrap.dedent("""
    import json, torch
    from gsm8kctl.sampling.backends.decode_attention import CHUNK, DecodeAttention
    torch.manual_seed(0)
    slots, max_len, kv_heads, rep, dim = 6, 600, 3, 3, 64
    k = torch.full((slots, max_len, kv_heads, dim), float("nan"))
    v = torch.full((slots, max_len, kv_heads, dim), float("nan"))
    # Two groups and a row alone: rows 0-2 read their first CHUNK + 8 keys (across the split
    # edge) from row 1, rows 3-4 their first 40 from row 4, row 5 only its own. Every other row's
    # prompt keys are NaN: a read of them instead of the group's row would show.
    prefix_row = torch.tensor([1, 1, 1, 4, 4, 5], dtype=torch.int32)
    prefix_len = torch.tensor([CHUNK + 8] * 3 + [40] * 2 + [0], dtype=torch.int32)
    n = torch.tensor([CHUNK + 9, CHUNK + 30, max_len, 41, 300, 77], dtype=torch.int32)
    for row, leader in enumerate(prefix_row.tolist()):
        lo = int(prefix_len[row]) if leader != row else 0
        k[row, lo:n[row]] = torch.randn(int(n[row]) - lo, kv_heads, dim)
        v[row, lo:n[row]] = torch.randn(int(n[row]) - lo, kv_heads, dim)
    q = torch.randn(slots, kv_heads, rep, dim)
    att = DecodeAttention(slots, max_len, kv_heads, rep, dim, torch.float32, "cpu")
    out = att(q, k, v, n, dim ** -0.5, prefix_row, prefix_len).clone()
    own = att(q, k, v, n, dim ** -0.5)  # no prefix given: every row its own keys (NaN where shared)
    err = 0.0
    for row, leader in enumerate(prefix_row.tolist()):
        plen, used = int(prefix_len[row]), int(n[row])
        kk = torch.cat([k[leader, :plen], k[row, plen:used]]).transpose(0, 1)
        vv = torch.cat([v[leader, :plen], v[row, plen:used]]).transpose(0, 1)
        ref = torch.softmax(q[row] @ kk.transpose(1, 2) * dim ** -0.5, -1) @ vv
        err = max(err, (out[row] - ref).abs().max().item())
    print(json.dumps({"err": err, "nan_without_prefix": [bool(own[r].isnan().any()) for r in range(slots)]}))
""")

SHARED_PROMPT_CHECK = TINY_LLAMA + textwrap.dedent("""
    class Watch(SlotEngine):
        \"\"\"Counts rows read from another row, and groups whose row moved while they decoded.\"\"\"
        shared = moved = 0
        def _repoint(self, owner):
            was = {self._group[r]: self._prefix_host[r] for r in range(self.slots)
                   if owner[r] is not None and self._prefix_host[r] != r}
            super()._repoint(owner)
            now = {self._group[r]: self._prefix_host[r] for r in range(self.slots) if owner[r] is not None}
            self.moved += sum(1 for g, p in was.items() if g in now and now[g] != p)
            self.shared = max(self.shared, sum(1 for r, p in enumerate(self._prefix_host) if p != r))

    rng = random.Random(1)
    prompts = [[rng.randrange(40, 512) for _ in range(rng.randrange(20, 90))] for _ in range(5)]
    # 5 problems x 6 attempts on 8 slots, sampled, ending at a stop token (ids 0-39, about 8 % of
    # the vocabulary) or after 30 tokens: a group's first row often finishes and takes another
    # prompt while the rest of its group decodes, and the drain compacts the rows.
    reqs = lambda: [Request(6 * p + a, prompt, seed=6 * p + a) for p, prompt in enumerate(prompts) for a in range(6)]
    out, watched = {}, {}
    for name, attention, share in (("sdpa", "sdpa", True), ("split_k", "split_k", False),
                                   ("split_k_shared", "split_k", True)):
        engine = Watch(model, slots=8, max_len=128, stop_ids=list(range(40)), pad_id=0, attention=attention,
                       share_prefix=share)
        done = {f.index: f.token_ids for f in engine.run(reqs(), temperature=1.0, top_p=1.0, max_tokens=30)}
        out[name] = [done[i] for i in range(len(done))]
        watched[name] = {"shared": engine.shared, "moved": engine.moved}
    lengths = [len(t) for t in out["sdpa"]]
    print(json.dumps({"same": out["sdpa"] == out["split_k"] == out["split_k_shared"], "watched": watched,
                      "lengths": [min(lengths), max(lengths)]}))
""")

ENGINE_CHECK = TINY_LLAMA + textwrap.dedent("""
    # Slots longer than a split.
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


COMPILE_CHECK = textwrap.dedent("""
    import inspect, json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from gsm8kctl.sampling.backends import decode_attention, fused
    partial, combine = decode_attention._build()
    add_rmsnorm, rope, silu_mul = fused._build()
    # Each kernel with what the engine launches it with on SmolLM2-135M in bf16: pointer and float
    # arguments, constexprs; every other argument is an int (a size or a stride).
    kernels = {
        "partial": (partial, {"Q": "bf16", "K": "bf16", "V": "bf16", "N": "i32", "P": "i32", "PL": "i32",
                              "A": "fp32", "ML": "fp32"}, {"scale"}, dict(R=3, RP=16, D=64, CHUNK=512, BLOCK_N=64)),
        "combine": (combine, {"A": "fp32", "ML": "fp32", "O": "bf16"}, set(), dict(SPLITS=2, R=3, RP=16, D=64)),
        "add_rmsnorm": (add_rmsnorm, {k: "bf16" for k in ("X", "R", "W", "OUT", "H")}, {"eps"},
                        dict(HAS_RESIDUAL=True, BLOCK=1024)),
        "rope": (rope, {k: "bf16" for k in ("QKV", "COS", "SIN", "Q", "K")}, set(),
                 dict(HEADS=9, KV_HEADS=3, D=64, HALF=32, BLOCK=32)),
        "silu_mul": (silu_mul, {"GU": "bf16", "OUT": "bf16"}, set(), dict(BLOCK=1024)),
    }
    out = {}
    for name, (kernel, pointers, floats, consts) in kernels.items():
        names = list(inspect.signature(kernel.fn).parameters)
        sig = {n: "constexpr" if n in consts else "*" + pointers[n] if n in pointers else "fp32" if n in floats
               else "i32" for n in names}
        src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
        for arch in (80, 90):
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
            out[f"{name} sm{arch}"] = sorted(compiled.asm)
    print(json.dumps(out))
""")


def _child(code: str, *args: str, interpret: bool = True) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"} if interpret else \
        {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
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


def test_kernel_reads_a_slots_prompt_keys_from_its_groups_row():
    """A slot's first prefix_len keys come from prefix_row, the rest from its own row, across a
    split edge; without the pointers the same rows read their own (NaN) prompt keys."""
    got = _child(PREFIX_CHECK)
    assert got["err"] < 1e-5
    assert got["nan_without_prefix"] == [True, False, True, True, False, False]


def test_slot_engine_sharing_prompt_reads_gives_the_same_tokens():
    """Attempts of one prompt read its keys from one busy row of their group, moved as rows finish,
    take other prompts and are compacted: the tokens are those of masked SDPA and of split-K
    reading each row's own copy."""
    got = _child(SHARED_PROMPT_CHECK)
    assert got["same"]
    assert got["watched"]["split_k_shared"]["shared"] >= 4  # rows did read another row's prompt
    assert got["watched"]["split_k_shared"]["moved"] > 0  # and a group's row moved under them
    assert got["watched"]["split_k"] == got["watched"]["sdpa"] == {"shared": 0, "moved": 0}
    assert got["lengths"][0] < got["lengths"][1] == 30


def test_the_kernels_compile_for_a_gpu():
    """The interpreter runs a kernel's Python, not what Triton compiles: each kernel the engine
    launches on CUDA compiles to a cubin for an A100 (sm80) and an H100 / H200 (sm90), here,
    without a GPU (Triton's compiler and ptxas are in its wheel)."""
    got = _child(COMPILE_CHECK, interpret=False)
    names = ("partial", "combine", "add_rmsnorm", "rope", "silu_mul")
    assert sorted(got) == sorted(f"{n} sm{a}" for n in names for a in (80, 90))
    assert all("cubin" in stages and "ptx" in stages for stages in got.values())


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

"""Decode attention over the slot cache, split over the keys (a Triton kernel, CUDA).

One decode step has one query token per slot. With grouped-query attention the `R` query heads
that share a kv head read the same keys, so the work is `slots x kv_heads` tiny problems of
`R` query rows against that slot's `n = pos + 1` keys. Flash attention's tiles are built for
long query blocks and read a decode step's cache at a third of the memory bandwidth (1.49 TB/s
on one H200, 2026-12-02; docs/benchmarks.md); this kernel is built for the decode shape:

- **Split over the keys.** Program `(slot, kv head, split)` reads keys `[split * CHUNK,
  min((split + 1) * CHUNK, n))` in tiles of `BLOCK_N` and keeps, for each of its query rows r,
  the running maximum m_r, the sum l_r = sum_j exp(s_rj - m_r) and the unnormalised output
  a_r = sum_j exp(s_rj - m_r) v_j, where s_rj = scale * q_r . k_j (the online softmax of flash
  attention). Splits past `n` write m = -inf, l = 0.
- **Combine.** Program `(slot, kv head)` merges its splits: with M = max_s m_s,
  out_r = sum_s exp(m_s - M) a_s / sum_s exp(m_s - M) l_s, which is softmax(s_r) V exactly.
- **A shared prompt is read from one row.** The attempts of one problem hold the same prompt
  keys (the slot engine prefills the prompt once and copies its rows). A slot's keys below
  `prefix_len[slot]` are read from row `prefix_row[slot]`, one busy row of its group, and the
  rest from its own row. The values are the same bits, so the output is too; but the group's
  16 programs then read one copy of the prompt, which stays in the L2 cache, instead of 16.

The grid is fixed by the cache's shape (slots, kv heads, max_len / CHUNK), so a step is
graph-capturable; how many keys a slot reads is data (its `n`), not shape. The `R` query rows
are padded to 16 for the tensor-core dot; the kernel is memory-bound, so the padding costs no
time. Kernels compile once per shape and are cached on disk by Triton (~/.triton/cache), so a
new process pays no compile.
"""

from __future__ import annotations

import os

import torch

CHUNK = 512  # keys per split
BLOCK_N = 64  # keys per tile inside a split

_kernels = None


def interpreted() -> bool:
    """Triton's interpreter runs the kernels on the CPU (numpy): how the tests check them."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Triton kernels in `dtype` run on `device`: CUDA in half precision with Triton
    importable (or the interpreter, on the CPU). Shared with fused.py."""
    if interpreted():
        return True
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    # Triton's tensor-core dot: fp16 from Volta (sm70), bf16 from Ampere (sm80).
    if torch.cuda.get_device_capability(device) < ((8, 0) if dtype == torch.bfloat16 else (7, 0)):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the split-K kernel runs here: Triton in half precision (`triton_runs`), and a
    power-of-two head size of at least 16 (the dot's smallest tile)."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return False
    return triton_runs(device, dtype)


def _build():
    """The two kernels, defined on first use: importing this module needs no Triton."""
    global _kernels
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def partial_kernel(Q, K, V, N, P, PL, A, ML,
                       s_qb, s_qh, s_qr, s_ks, s_kl, s_kh, s_vs, s_vl, s_vh,
                       s_ab, s_ah, s_as, s_ar, s_mb, s_mh, s_ms,
                       scale, R: tl.constexpr, RP: tl.constexpr, D: tl.constexpr,
                       CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        n = tl.load(N + b)
        prow = tl.load(P + b)  # the row holding this slot's prompt keys, below plen
        plen = tl.load(PL + b)
        r = tl.arange(0, RP)
        d = tl.arange(0, D)
        q = tl.load(Q + b * s_qb + h * s_qh + r[:, None] * s_qr + d[None, :], mask=(r < R)[:, None], other=0.0)
        m_i = tl.full([RP], float("-inf"), tl.float32)
        l_i = tl.zeros([RP], tl.float32)
        acc = tl.zeros([RP, D], tl.float32)
        lo = s * CHUNK
        hi = tl.minimum(lo + CHUNK, n)
        for start in range(lo, hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            live = j < hi
            row = tl.where(j < plen, prow, b)
            k = tl.load(K + row[:, None] * s_ks + j[:, None] * s_kl + h * s_kh + d[None, :], mask=live[:, None],
                        other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where(live[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + row[:, None] * s_vs + j[:, None] * s_vl + h * s_vh + d[None, :], mask=live[:, None],
                        other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        tl.store(A + b * s_ab + h * s_ah + s * s_as + r[:, None] * s_ar + d[None, :], acc)
        tl.store(ML + b * s_mb + h * s_mh + s * s_ms + r, m_i)
        tl.store(ML + b * s_mb + h * s_mh + s * s_ms + RP + r, l_i)

    @triton.jit
    def combine_kernel(A, ML, O, s_ab, s_ah, s_as, s_ar, s_mb, s_mh, s_ms, s_ob, s_oh, s_or,
                       SPLITS: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        r = tl.arange(0, RP)
        d = tl.arange(0, D)
        m_all = tl.full([RP], float("-inf"), tl.float32)
        for s in range(SPLITS):
            m_all = tl.maximum(m_all, tl.load(ML + b * s_mb + h * s_mh + s * s_ms + r))
        num = tl.zeros([RP, D], tl.float32)
        den = tl.zeros([RP], tl.float32)
        for s in range(SPLITS):
            m_s = tl.load(ML + b * s_mb + h * s_mh + s * s_ms + r)
            w = tl.exp(m_s - m_all)  # 0 for a split past the slot's keys (m_s = -inf)
            den += w * tl.load(ML + b * s_mb + h * s_mh + s * s_ms + RP + r)
            num += w[:, None] * tl.load(A + b * s_ab + h * s_ah + s * s_as + r[:, None] * s_ar + d[None, :])
        out = num / den[:, None]
        tl.store(O + b * s_ob + h * s_oh + r[:, None] * s_or + d[None, :], out.to(O.dtype.element_ty),
                 mask=(r < R)[:, None])

    _kernels = (partial_kernel, combine_kernel)
    return _kernels


class DecodeAttention:
    """Scratch buffers for `slots` rows of one cache shape, and the two launches.

    `__call__(q, k_cache, v_cache, n, scale, prefix_row, prefix_len)`: q [b, kv_heads, R, D]
    (b <= slots), caches [slots, L, kv_heads, D], n [b] int32 keys per slot; optionally, per slot
    (int32, at least b), the row its first `prefix_len` keys are read from (see the module's
    docstring); returns [b, kv_heads, R, D].
    """

    def __init__(self, slots: int, max_len: int, kv_heads: int, rep: int, head_dim: int, dtype, device,
                 chunk: int = CHUNK, block_n: int = BLOCK_N, warps: int = 4, stages: int = 3):
        self.chunk, self.block_n, self.warps, self.stages = chunk, block_n, warps, stages
        self.splits = -(-max_len // chunk)
        self.rep, self.rp, self.dim = rep, max(16, 1 << (rep - 1).bit_length()), head_dim
        # Partial outputs and (m, l) per split, float32; written whole by every step.
        self.acc = torch.empty((slots, kv_heads, self.splits, self.rp, head_dim), dtype=torch.float32, device=device)
        self.ml = torch.empty((slots, kv_heads, self.splits, 2 * self.rp), dtype=torch.float32, device=device)
        self.out = torch.empty((slots, kv_heads, rep, head_dim), dtype=dtype, device=device)
        # No shared prompt: each slot reads its own row only.
        self.own_row = torch.arange(slots, dtype=torch.int32, device=device)
        self.no_prefix = torch.zeros(slots, dtype=torch.int32, device=device)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n: torch.Tensor,
                 scale: float, prefix_row: torch.Tensor | None = None,
                 prefix_len: torch.Tensor | None = None) -> torch.Tensor:
        partial_kernel, combine_kernel = _build()
        b, kv_heads = q.shape[:2]
        acc, ml, out = self.acc, self.ml, self.out[:b]
        if prefix_row is None:
            prefix_row, prefix_len = self.own_row, self.no_prefix
        partial_kernel[(b, kv_heads, self.splits)](
            q, k_cache, v_cache, n, prefix_row, prefix_len, acc, ml,
            q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            acc.stride(0), acc.stride(1), acc.stride(2), acc.stride(3), ml.stride(0), ml.stride(1), ml.stride(2),
            scale, R=self.rep, RP=self.rp, D=self.dim, CHUNK=self.chunk, BLOCK_N=self.block_n,
            num_warps=self.warps, num_stages=self.stages)
        combine_kernel[(b, kv_heads)](
            acc, ml, out, acc.stride(0), acc.stride(1), acc.stride(2), acc.stride(3),
            ml.stride(0), ml.stride(1), ml.stride(2), out.stride(0), out.stride(1), out.stride(2),
            SPLITS=self.splits, R=self.rep, RP=self.rp, D=self.dim, num_warps=self.warps)
        return out

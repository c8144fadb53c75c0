"""Fused kernels for backends/llama.py's forward on CUDA in half precision (Triton).

A decode step of a small model is launch-bound: the 135M model's eager layer is ~40 kernels
(RMSNorm alone is eight: upcast, square, mean, add, rsqrt, multiply, downcast, weight), and a
30-layer step replayed from a CUDA graph spent ~4.4 ms of its 8.1 ms at 1024 slots outside
attention, against ~0.4 ms of arithmetic (one H200, 2026-12-02; docs/benchmarks.md). These three kernels, with q/k/v
and gate/up each one matmul over concatenated weights (llama.py), make a layer ~12 kernels:

- `add_rmsnorm(x, residual, weight, eps)`: h = residual + x (rounded to the activations' dtype,
  as the eager add), then weight * (h * rsqrt(mean(h^2) + eps)) computed in float32 and rounded
  as transformers' RMSNorm rounds it. One program per row. The sum over the row is Triton's,
  so its last float32 bit can differ from torch's mean: results agree to rounding, not bit for bit.
- `rope(q, k, cos, sin)`: x * cos + rotate_half(x) * sin for the query and key heads of each
  token in one launch, each product and the sum rounded as the eager ops round them.
- `silu_mul(gate_up)`: silu(g) * u over the two halves of the fused gate/up projection.

float32 runs (the parity checks, the CPU) keep the eager ops. Kernels compile once per shape and
Triton caches them on disk, as for decode_attention.py; tests run them in Triton's interpreter.
"""

from __future__ import annotations

import torch

from gsm8kctl.sampling.backends.decode_attention import triton_runs

_kernels = None


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA in half precision with Triton, or the interpreter (tests)."""
    return triton_runs(device, dtype)


def _build():
    global _kernels
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def add_rmsnorm_kernel(X, R, W, OUT, H, n, eps, s_x, s_r, s_o, s_h,
                           HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        live = c < n
        x = tl.load(X + row * s_x + c, mask=live, other=0.0)
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(R + row * s_r + c, mask=live, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(H + row * s_h + c, x, mask=live)
        h = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(h * h, 0) / n + eps)
        w = tl.load(W + c, mask=live, other=0.0).to(tl.float32)
        normed = (h * inv).to(x.dtype).to(tl.float32)
        tl.store(OUT + row * s_o + c, (w * normed).to(x.dtype), mask=live)

    @triton.jit
    def rope_kernel(QKV, COS, SIN, Q, K, s_t, s_c, s_q, s_k, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                    D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
        # Program (token, head): heads [0, HEADS) are the query's, then KV_HEADS of the key's.
        t = tl.program_id(0)
        h = tl.program_id(1)
        i = tl.arange(0, BLOCK)
        live = i < HALF
        src = QKV + t * s_t + h * D
        x1 = tl.load(src + i, mask=live).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=live).to(tl.float32)
        c1 = tl.load(COS + t * s_c + i, mask=live).to(tl.float32)
        c2 = tl.load(COS + t * s_c + HALF + i, mask=live).to(tl.float32)
        s1 = tl.load(SIN + t * s_c + i, mask=live).to(tl.float32)
        s2 = tl.load(SIN + t * s_c + HALF + i, mask=live).to(tl.float32)
        ty = Q.dtype.element_ty
        # Eager: (x * cos) + (cat(-x2, x1) * sin), each op rounded to the activations' dtype.
        lo = ((x1 * c1).to(ty).to(tl.float32) + (-x2 * s1).to(ty).to(tl.float32)).to(ty)
        hi = ((x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)).to(ty)
        if h < HEADS:
            dst = Q + t * s_q + h * D
        else:
            dst = K + t * s_k + (h - HEADS) * D
        tl.store(dst + i, lo, mask=live)
        tl.store(dst + HALF + i, hi, mask=live)

    @triton.jit
    def silu_mul_kernel(GU, OUT, n, s_g, s_o, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = c < n
        g = tl.load(GU + row * s_g + c, mask=live, other=0.0)
        u = tl.load(GU + row * s_g + n + c, mask=live, other=0.0).to(tl.float32)
        g32 = g.to(tl.float32)
        act = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype).to(tl.float32)
        tl.store(OUT + row * s_o + c, (act * u).to(g.dtype), mask=live)

    _kernels = (add_rmsnorm_kernel, rope_kernel, silu_mul_kernel)
    return _kernels


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x); with `residual` None, (RMSNorm(x), x)."""
    kernel = _build()[0]
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x)
    out = torch.empty_like(x2)
    h = torch.empty_like(x2) if residual is not None else x2
    r2 = _rows(residual) if residual is not None else x2
    block = triton_next_pow2(n)
    kernel[(x2.shape[0],)](x2, r2, weight, out, h, n, eps, x2.stride(0), r2.stride(0), out.stride(0), h.stride(0),
                           HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=4)
    return out.view(shape), h.view(shape)


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
         head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated query [.., heads, D] and key [.., kv_heads, D] from the fused projection's output
    [.., (heads + 2 kv_heads) D] (the value part is left where it is)."""
    kernel = _build()[1]
    lead = qkv.shape[:-1]
    flat = _rows(qkv)
    tokens = flat.shape[0]
    q = torch.empty((tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((tokens, kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    c, s = _rows(cos.expand(*lead, head_dim)), _rows(sin.expand(*lead, head_dim))
    if c.stride(0) != s.stride(0):
        c, s = c.contiguous(), s.contiguous()
    kernel[(tokens, heads + kv_heads)](flat, c, s, q, k, flat.stride(0), c.stride(0), q.stride(0), k.stride(0),
                                       HEADS=heads, KV_HEADS=kv_heads, D=head_dim, HALF=head_dim // 2,
                                       BLOCK=triton_next_pow2(head_dim // 2), num_warps=1)
    return q.view(*lead, heads, head_dim), k.view(*lead, kv_heads, head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the halves of the last dimension."""
    kernel = _build()[2]
    n = gate_up.shape[-1] // 2
    g = _rows(gate_up)
    out = torch.empty((g.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton_next_pow2(n))
    kernel[(g.shape[0], -(-n // block))](g, out, n, g.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], n)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()

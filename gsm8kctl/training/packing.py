"""Packed micro-batches: a micro-batch's samples laid end to end as one row, with no padding.

Padded, a micro-batch costs rows × its longest row, and every new width is a new shape for the
compiled decoder layers. On one H200 (2026-12-01) the warm start over gold solutions of 150–700 tokens ran at
~25 k tokens/s with 8–31 s recompiles, against ~200 k for fixed 1024-token rows.

Packed, the trainer runs one row of sum(lengths) tokens. Positions restart at 0 for each sample,
and attention stays inside each sample:
- on CUDA in bf16, flash varlen attention over the cumulative offsets `cu` (forward and backward
  in one kernel each, no mask);
- elsewhere, causal SDPA per sample: the reference that the CPU tests compare with the padded path.

The per-token outputs go back to the padded [B, T] layout (`unpack`), so the loss sees the same
tensors either way. Packed and padded are the same function of the weights; they differ in float
rounding only.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_NAME = "gsm8kctl_packed"


@dataclass
class Packed:
    ids: torch.Tensor  # [1, N] the samples end to end
    positions: torch.Tensor  # [1, N] 0..len-1 within each sample
    score: torch.Tensor  # [1, N] bool: completion tokens
    cu: torch.Tensor  # [k + 1] int32 offsets of the samples
    max_len: int
    bounds: list[tuple[int, int]]


class _Segments:
    """The segments of the packed row being run (read by the attention function)."""
    packed: Packed | None = None
    flash: bool = False


_SEG = _Segments()


def pack(prompts: list[list[int]], completions: list[list[int]], device) -> Packed:
    ids, positions, score, bounds = [], [], [], []
    for p, c in zip(prompts, completions):
        start = len(ids)
        ids += list(p) + list(c)
        positions += range(len(p) + len(c))
        score += [False] * len(p) + [True] * len(c)
        bounds.append((start, len(ids)))
    cu = [0] + [b for _, b in bounds]
    return Packed(
        ids=torch.tensor([ids], dtype=torch.long, device=device),
        positions=torch.tensor([positions], dtype=torch.long, device=device),
        score=torch.tensor([score], dtype=torch.bool, device=device),
        cu=torch.tensor(cu, dtype=torch.int32, device=device),
        max_len=max(b - a for a, b in bounds),
        bounds=bounds,
    )


def unpack(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[1, N] packed values -> [B, T] in the padded layout (0 at padding), differentiably.

    The padded layout's real tokens, read row by row, are exactly the packed order.
    """
    out = values.new_zeros(attention_mask.shape)
    return out.masked_scatter(attention_mask.bool(), values[0])


@torch.compiler.disable  # runs eagerly: segment counts and lengths change every micro-batch
def _packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [1, H, N, D], key/value [1, Hkv, N, D] (RoPE applied) -> [1, N, H, D]."""
    packed = _SEG.packed
    if _SEG.flash:
        # bf16 as autocast gives SDPA: RoPE's fp32 cos/sin leave query and key in fp32.
        q, k, v = (x[0].transpose(0, 1).to(torch.bfloat16).contiguous() for x in (query, key, value))
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, packed.cu, packed.cu, packed.max_len, packed.max_len, 0.0, True, False, scale=scaling)[0]
        return out.unsqueeze(0), None
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                            is_causal=True, scale=scaling)
             for a, b in packed.bounds]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def flash_available(device, bf16: bool) -> bool:
    """Whether flash varlen attention runs forward and backward here (CUDA, bf16 autocast)."""
    if not (bf16 and getattr(device, "type", str(device)) == "cuda"):
        return False
    try:
        q = torch.randn((4, 2, 64), dtype=torch.bfloat16, device=device, requires_grad=True)
        kv = torch.randn((4, 1, 64), dtype=torch.bfloat16, device=device)
        cu = torch.tensor([0, 1, 4], dtype=torch.int32, device=device)
        out = torch.ops.aten._flash_attention_forward(q, kv, kv, cu, cu, 3, 3, 0.0, True, False)[0]
        out.sum().backward()
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


_REGISTERED = False


@contextmanager
def segments(lm, packed: Packed, *, flash: bool):
    """Run `lm` over a packed row: its attention reads `packed`'s segments (restored after)."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, _packed_attention)
        _REGISTERED = True
    saved = lm.config._attn_implementation
    lm.config._attn_implementation = ATTN_NAME
    _SEG.packed, _SEG.flash = packed, flash
    try:
        yield
    finally:
        lm.config._attn_implementation = saved
        _SEG.packed = None

"""Choosing a token from log-probs, with a seed per completion (transformers backend).

Each completion draws its randomness from its own stream: `uniforms(seed, n)` is the sequence
u_0, u_1, ... in [0, 1) that its tokens consume in order, whatever else shares the batch. Token
t of a completion is the inverse-CDF pick of u_t:

    p = softmax(logp / T)            (T = temperature; raw log-probs when T = 1)
    p = p restricted to the top-p nucleus: the tokens at least as likely as the last one of the
        smallest prefix by probability whose mass reaches top_p (ties at the cut are kept)
    token = min{ i : sum_{j <= i} p_j > u_t * sum_j p_j }

So a completion is a function of (seed, the model's log-probs along its path) alone: the same
seed gives the same tokens in any batch, slot or order, as long as the log-probs are the same.
They are on the CPU in float32; on a GPU the kernels of a different batch shape can change the
last bits of a logit, and then a near-tie can go the other way (see docs/architecture.md).
"""

from __future__ import annotations

import hashlib

import torch


def completion_seed(*parts: object) -> int:
    """A 63-bit seed from any identifying parts, e.g. (config seed, tape id)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def uniforms(seed: int, n: int) -> torch.Tensor:
    """The first `n` uniforms of a completion's stream (float64 on the CPU, from torch's CPU RNG)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return torch.rand(n, generator=gen, dtype=torch.float64)


def choose(logp: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Token ids [B] from raw log-probs [B, V] (float32) and one uniform per row [B].

    Shapes stay fixed and nothing syncs with the host, so this runs inside a CUDA graph.
    """
    if temperature <= 0:
        return logp.argmax(-1)
    # softmax(logits / T) == softmax(logp / T): no second pass over the raw logits.
    probs = logp.exp() if temperature == 1.0 else torch.softmax(logp / temperature, dim=-1)
    if top_p < 1.0:
        # The nucleus as a probability cut: the smallest prefix by probability whose mass reaches
        # top_p (at least one token), then every token at least that likely, kept in vocabulary
        # order. Sampling in sorted order instead would let the last bit of a logit reorder
        # near-equal tokens and change the pick; this way only the cut itself is that sensitive.
        ranked = probs.sort(dim=-1, descending=True).values
        kept = (ranked.cumsum(-1) - ranked <= top_p).sum(-1, keepdim=True).clamp_(min=1)
        probs = probs.masked_fill(probs < ranked.gather(-1, kept - 1), 0.0)
    cdf = probs.cumsum(-1)
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    # right=True: the first index whose cumulative mass exceeds the target, so a token of
    # probability 0 is never picked (u = 0 included).
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    return idx.squeeze(-1)

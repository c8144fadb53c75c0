"""Per-token log-probs of chosen tokens, in chunks, so a 150k-token vocabulary never materialises
full fp32 logits for a batch.

For a causal LM the log-prob of token t is log softmax(W h_{t-1})[x_t]. We run the decoder once
to get hidden states h, keep only the positions whose next token is scored (the completion),
and project them through the output embedding `chunk_tokens` rows at a time. Under autograd each
chunk is recomputed in backward (activation checkpointing), so peak memory is one chunk of
logits (chunk_tokens x vocab fp32) instead of batch x seq x vocab: for the 1.5B shape at batch
32 x 1024 that is 0.6 GiB instead of 18.5 GiB.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    targets: torch.Tensor, want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float()
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if want_entropy:
        entropy = -(logp.exp() * logp).sum(-1)
    else:
        entropy = torch.zeros_like(chosen)
    return chosen, entropy


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   score_mask: torch.Tensor, *, chunk_tokens: int = 1024,
                   position_ids: torch.Tensor | None = None,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `input_ids[b, t]` given `input_ids[b, :t]`, for every (b, t) with score_mask.

    Returns (logprobs, entropy), each [B, T] float32, zero where score_mask is False; entropy is
    the full-distribution entropy at those positions when `with_entropy`, else None.
    `score_mask[:, 0]` must be False (the first token has no context). `attention_mask=None`
    (with `position_ids`) is for right-padded rows, where causal attention alone is exact.
    """
    if position_ids is None:
        # Left padding shifts positions; count from the first real token of each row.
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    decoder = model.get_decoder()
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=position_ids).last_hidden_state
    out_emb = model.get_output_embeddings()
    weight, bias = out_emb.weight, getattr(out_emb, "bias", None)

    # Position t is predicted from hidden state t-1.
    pred_mask = torch.zeros_like(score_mask)
    pred_mask[:, :-1] = score_mask[:, 1:]
    h = hidden[pred_mask]  # [N, H]
    targets = input_ids[score_mask]  # [N], same (row-major) order as h
    chosen_parts, entropy_parts = [], []
    use_ckpt = torch.is_grad_enabled() and h.requires_grad
    for start in range(0, h.shape[0], chunk_tokens):
        hc, tc = h[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if use_ckpt:
            c, e = checkpoint(_chunk_logprobs, hc, weight, bias, tc, with_entropy, use_reentrant=False)
        else:
            c, e = _chunk_logprobs(hc, weight, bias, tc, with_entropy)
        chosen_parts.append(c)
        entropy_parts.append(e)
    logprobs = torch.zeros(score_mask.shape, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros_like(logprobs) if with_entropy else None
    if chosen_parts:
        logprobs = logprobs.masked_scatter(score_mask, torch.cat(chosen_parts))
        if with_entropy:
            entropy = entropy.masked_scatter(score_mask, torch.cat(entropy_parts).detach())
    return logprobs, entropy


def chosen_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 1024) -> torch.Tensor:
    """log softmax(lm_head(hidden[n]))[targets[n]] for hidden [N, H], `chunk_tokens` rows of logits
    at a time (inference: no autograd, nothing kept but the chosen log-probs)."""
    out_emb = model.get_output_embeddings()
    weight, bias = out_emb.weight, getattr(out_emb, "bias", None)
    parts = [_chunk_logprobs(hidden[i:i + chunk_tokens], weight, bias, targets[i:i + chunk_tokens], False)[0]
             for i in range(0, hidden.shape[0], chunk_tokens)]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def pad_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad prompt+completion rows; returns input_ids, attention_mask, completion mask."""
    # Built in numpy from one flat array: per-row tensor copies cost more than the forward for
    # the 135M model on a GPU, at thousands of rows per score() call.
    prompt_lens = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
    lengths = prompt_lens + np.fromiter(map(len, completions), dtype=np.int64, count=len(completions))
    flat = np.fromiter(chain.from_iterable(chain(p, c) for p, c in zip(prompts, completions)),
                       dtype=np.int64, count=int(lengths.sum()))
    columns = np.arange(int(lengths.max()))
    real = columns < lengths[:, None]
    ids = np.full(real.shape, pad_id, dtype=np.int64)
    ids[real] = flat  # row-major, as flat is laid out
    comp = real & (columns >= prompt_lens[:, None])
    return (torch.from_numpy(ids).to(device), torch.from_numpy(real.astype(np.int64)).to(device),
            torch.from_numpy(comp).to(device))


def token_budget_batches(lengths: list[int], token_budget: int, max_batch: int | None = None,
                         *, packed: bool = False) -> list[list[int]]:
    """Group indices (sorted by length) so each group fits the budget: its padded size
    rows x max_len, or with `packed` (samples end to end, gsm8kctl/training/packing.py) its total length."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i in order:
        # Ascending order: the row joining is the group's longest.
        cost = total + lengths[i] if packed else (len(cur) + 1) * lengths[i]
        if cur and (cost > token_budget or (max_batch and len(cur) >= max_batch)):
            batches.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += lengths[i]
    if cur:
        batches.append(cur)
    return batches

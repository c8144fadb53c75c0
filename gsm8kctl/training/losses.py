"""Training objectives (docs/architecture.md, "The loop"): pure functions, no model, no optimizer.

Notation. For completion token t of sample i:
    new_t = log π_θ(x_t | x_<t)   trainer log-prob (carries the gradient)
    old_t = sampler log-prob       (recorded at sampling time, `old_logprobs`)
    ref_t = reference log-prob     (`ref_logprobs`, from `filter --ref-model`)
    m_t   = 1 on completion tokens, 0 on prompt and padding
    w_i   = per-sample weight: group advantage A_i or (shaped) reward r_i, chosen by `filter`;
            `relu_weights`: w_i = max(w_i, 0) (learn from better-than-average samples only).

Per-sample reward shaping, before advantages (implicit KL, Ahmadian et al. 2024, arXiv
2402.14740, Eq. 3):
    r'_i = r_i − β · KL_i
    KL_i = Σ_t (old_t − ref_t)                         estimator k1 (default)
    KL_i = Σ_t exp(ref_t − old_t) − (ref_t − old_t) − 1  estimator k3 (what the original code did)

Group advantages (group = one problem in one iteration):
    A_i = (r'_i − mean_g r') / (std_g r' + 1e-4)      `divide_by_std` (default)
    A_i =  r'_i − mean_g r'                           without it (Dr. GRPO, Liu et al. 2025,
                                                      arXiv 2503.20783: the std favours groups
                                                      whose rewards barely differ)
std is the sample standard deviation (ddof = 1, as the original pandas code computed it); a group
of one has std 0, hence A = 0. A group whose rewards are all equal has A = 0 for every member:
no signal, only compute — `filter` counts (and optionally drops) such groups.

Per-token loss ℓ_t by objective:
    sft        ℓ_t = −new_t                                    (NLL on kept successes)
    reinforce  ℓ_t = −w_i · new_t
    grpo       ℓ_t = −min(ρ_t w_i, clip(ρ_t, 1 − ε, 1 + ε_high) w_i),   ρ_t = exp(new_t − old_t)
               ε_high = ε unless set (DAPO's clip-higher, Yu et al. 2025, arXiv 2503.14476: a
               wider upper bound lets unlikely tokens of good samples grow, against entropy collapse)
plus the explicit KL penalty (`kl_coef` β, k3 estimator of KL(π_θ ‖ π_ref), ≥ 0 per token):
    ℓ_t += β · (exp(ref_t − new_t) − (ref_t − new_t) − 1)

Normalisation ("per token"; "divide by accumulation passes"):
    loss = Σ_t m_t ℓ_t / N / P
N defaults to Σ_t m_t of the micro-batch and P to 1: the classic token mean per micro-batch,
divided by the P accumulation passes. `finetune` passes N = completion tokens of the whole
optimizer step (÷ number of processes, since DDP averages gradients) and P = 1: the exact token
mean over the step, whatever the micro-batching or the number of GPUs. The two agree when every
pass has the same token count. This is the token-level normalisation of DAPO and Dr. GRPO: a
long sample weighs by its tokens, not as one sample averaged over its own length.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

import torch

OBJECTIVES = ("sft", "reinforce", "grpo")
KL_ESTIMATORS = ("k1", "k3")
ADV_EPS = 1e-4


# ---------------------------------------------------------------------------------------------
# Per-sample: reward shaping and group advantages (plain floats; `filter` uses these)


def implicit_kl(old: Sequence[float], ref: Sequence[float], estimator: str = "k1") -> float:
    """KL_i summed over the completion tokens: k1 = Σ(old − ref); k3 = Σ exp(ref−old) − (ref−old) − 1."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"implicit_kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if len(old) != len(ref):
        raise ValueError(f"old and ref log-probs differ in length ({len(old)} vs {len(ref)})")
    if estimator == "k1":
        return float(sum(o - r for o, r in zip(old, ref)))
    return float(sum(math.exp(r - o) - (r - o) - 1.0 for o, r in zip(old, ref)))


def shaped_reward(reward: float, old: Sequence[float] | None, ref: Sequence[float] | None,
                  coef: float, estimator: str = "k1") -> float:
    """r' = r − β·KL_i (unchanged when β = 0)."""
    if not coef:
        return float(reward)
    if old is None or ref is None:
        raise ValueError("implicit KL needs both sampler and reference log-probs")
    return float(reward) - coef * implicit_kl(old, ref, estimator)


def group_advantages(rewards: Sequence[float], group_ids: Sequence[str], eps: float = ADV_EPS,
                     divide_by_std: bool = True) -> list[float]:
    """A_i = (r_i − mean_g) / (std_g + eps), std with ddof = 1 (0 for a group of one); without
    `divide_by_std`, A_i = r_i − mean_g."""
    if len(rewards) != len(group_ids):
        raise ValueError("rewards and group_ids differ in length")
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    adv = [0.0] * len(rewards)
    for idx in members.values():
        rs = [float(rewards[i]) for i in idx]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1)) if len(rs) > 1 else 0.0
        for i, r in zip(idx, rs):
            adv[i] = (r - mean) / (std + eps) if divide_by_std else r - mean
    return adv


def uniform_groups(rewards: Sequence[float], group_ids: Sequence[str]) -> set[str]:
    """Groups whose rewards are all equal (a group of one included): zero advantage everywhere."""
    seen: dict[str, set[float]] = defaultdict(set)
    for r, g in zip(rewards, group_ids):
        seen[g].add(float(r))
    return {g for g, rs in seen.items() if len(rs) == 1}


# ---------------------------------------------------------------------------------------------
# Per-token: the policy loss of one micro-batch


def k3(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """exp(ref − logp) − (ref − logp) − 1, elementwise (≥ 0; KL(π‖π_ref) in expectation under π)."""
    d = ref - logp
    return torch.exp(d) - d - 1.0


def policy_loss(
    new: torch.Tensor,
    mask: torch.Tensor,
    *,
    objective: str,
    weights: torch.Tensor | None = None,
    old: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    old_mask: torch.Tensor | None = None,
    ref_mask: torch.Tensor | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    kl_coef: float = 0.0,
    relu_weights: bool = False,
    normalizer: float | torch.Tensor | None = None,
    accumulation_passes: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch (module docstring for the formulas) and summed statistics.

    new, old, ref, masks: [B, T]; weights: [B]. `old_mask`/`ref_mask` mark tokens whose old/ref
    log-prob is known (default: `mask`). Returns (loss, sums) where sums holds token-summed
    statistics — `tokens`, `loss_sum` (Σ m ℓ), `ratio_sum`/`ratio_tokens`, `clipped`,
    `kl_sum`/`kl_tokens` — so callers can aggregate over passes and processes exactly
    (`summarize` turns them into means). Sums stay 0-d tensors: no device sync per pass.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    m = mask.to(new.dtype)
    tokens = m.sum()
    old_m = (mask if old_mask is None else old_mask & mask).to(new.dtype)
    ref_m = (mask if ref_mask is None else ref_mask & mask).to(new.dtype)

    if objective != "sft":
        if weights is None:
            raise ValueError(f"objective {objective} needs per-sample weights")
        w = weights.to(new.dtype)
        if relu_weights:
            w = w.clamp(min=0.0)
        w = w.unsqueeze(-1)  # [B, 1], broadcast over tokens

    sums: dict[str, torch.Tensor] = {"tokens": tokens.detach()}
    ratio = None
    if old is not None:
        # Where old is unknown, pretend ρ = 1 (new − new): no ratio, no clipping, plain gradient.
        old_filled = torch.where(old_m.bool(), old, new.detach())
        ratio = torch.exp(new - old_filled)
        sums["ratio_sum"] = (ratio.detach() * old_m).sum()
        sums["ratio_tokens"] = old_m.sum()

    if objective == "sft":
        per_token = -new
    elif objective == "reinforce":
        per_token = -w * new
    else:
        if ratio is None:
            raise ValueError("grpo needs the sampler's old log-probs")
        high = epsilon if epsilon_high is None else epsilon_high
        unclipped = ratio * w
        clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + high) * w
        per_token = -torch.minimum(unclipped, clipped)
        # Clip is active (gradient zero) where ρ left the trust region in the direction of w.
        r = ratio.detach()
        active = ((r > 1.0 + high) & (w > 0)) | ((r < 1.0 - epsilon) & (w < 0))
        sums["clipped"] = (active.to(new.dtype) * old_m).sum()

    if ref is not None:
        kl_tok = k3(new, torch.where(ref_m.bool(), ref, new.detach()))
        sums["kl_sum"] = (kl_tok.detach() * ref_m).sum()
        sums["kl_tokens"] = ref_m.sum()
        if kl_coef:
            per_token = per_token + kl_coef * kl_tok * ref_m
    elif kl_coef:
        raise ValueError("kl_coef > 0 needs reference log-probs (filter --ref-model)")

    loss_sum = (per_token * m).sum()
    sums["loss_sum"] = loss_sum.detach()
    n = tokens.clamp(min=1.0) if normalizer is None else normalizer
    loss = loss_sum / n / accumulation_passes
    return loss, sums


def add_sums(total: dict, part: dict) -> dict:
    """Accumulate `policy_loss` sums in place (over passes; all-reduce them over processes)."""
    for k, v in part.items():
        total[k] = total.get(k, 0.0) + v
    return total


def summarize(sums: dict) -> dict[str, float | None]:
    """Means from summed statistics: loss per token, mean ratio, clip fraction, KL (k3)."""
    sums = {k: float(v) for k, v in sums.items()}

    def ratio(a: str, b: str) -> float | None:
        return sums[a] / sums[b] if sums.get(b) else None

    return {
        "loss_per_token": ratio("loss_sum", "tokens"),
        "ratio_mean": ratio("ratio_sum", "ratio_tokens"),
        "clip_frac": ratio("clipped", "ratio_tokens") if "clipped" in sums else None,
        "kl": ratio("kl_sum", "kl_tokens"),
    }

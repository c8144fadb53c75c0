"""The host side of `score()`: batching, padding and cutting log-probs into rows, without a model.

    python bench/bench_score_host.py --rows 8192 --against 5c91cee~1   # the tree before the vectorised score()

On one H200 (2026-12-02, commit 14d38d4), score() ran at 151-185 k scored tokens/s against
571-720 k for the decoder forward alone; part of the difference was this Python work, which
runs while the GPU waits (docs/benchmarks.md, "The host side of `score()`"). This times the three host steps of `TransformersBackend.score` on synthetic rows of
GSM8k's lengths (prompts 120-220 tokens, completions 30-320), for this tree's
`gsm8kctl/training/logprobs.py` and, with `--against REV`, for the one at a git revision, side by side
and alternating, and prints the medians. The log-probs are random numbers of the right shape:
what is timed is moving them, not computing them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def load_logprobs(rev: str | None):
    """gsm8kctl/training/logprobs.py of this tree, or of git revision `rev`, as a module."""
    if rev is None:
        import gsm8kctl.training.trainer.logprobs as mod

        return mod
    from module_at import module_at

    return module_at(rev, "gsm8kctl/training/logprobs.py")


def cut_rows_per_row(lp, mask, group, out):
    """The row cutting before this change: one boolean index and one list per row."""
    for j, i in enumerate(group):
        out[i] = lp[j][mask[j]].tolist()


def cut_rows_flat(lp, mask, group, out, completions):
    """The row cutting of TransformersBackend.score now: one list per chunk, sliced."""
    values = lp.numpy()[mask.numpy()].tolist()
    start = 0
    for i in group:
        out[i] = values[start:start + len(completions[i])]
        start += len(completions[i])


def one_pass(mod, prompts, completions, budget, flat_cut: bool) -> dict:
    import torch

    times = {"batches": 0.0, "pad": 0.0, "cut": 0.0}
    t0 = time.perf_counter()
    groups = mod.token_budget_batches([len(p) + len(c) for p, c in zip(prompts, completions)], budget)
    times["batches"] = time.perf_counter() - t0
    out = [None] * len(prompts)
    for group in groups:
        t0 = time.perf_counter()
        ids, _, mask = mod.pad_batch([prompts[i] for i in group], [completions[i] for i in group], 0)
        times["pad"] += time.perf_counter() - t0
        lp = torch.rand(ids.shape)
        t0 = time.perf_counter()
        if flat_cut:
            cut_rows_flat(lp, mask, group, out, completions)
        else:
            cut_rows_per_row(lp, mask, group, out)
        times["cut"] += time.perf_counter() - t0
    assert [len(o) for o in out] == [len(c) for c in completions]
    times["total"] = sum(times.values())
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=65536, help="tokens per padded batch (filter.score_token_budget)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--against", help="a git revision whose gsm8kctl/training/logprobs.py (and per-row cutting) to compare")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(49152) for _ in range(rng.randint(120, 220))] for _ in range(args.rows)]
    completions = [[rng.randrange(49152) for _ in range(rng.randint(30, 320))] for _ in range(args.rows)]
    variants = {"this tree": (load_logprobs(None), True)}
    if args.against:
        variants[args.against] = (load_logprobs(args.against), False)
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.repeats):  # alternating, so drift in the machine's load hits both
        for name, (mod, flat_cut) in variants.items():
            runs[name].append(one_pass(mod, prompts, completions, args.budget, flat_cut))
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    tokens = sum(map(len, prompts)) + sum(map(len, completions))
    print(f"{args.rows} rows, {tokens} tokens, budget {args.budget}; median of {args.repeats} (seconds)")
    print(f"| code | batches | pad | cut into rows | total |\n|---|---|---|---|---|")
    for name, m in medians.items():
        print(f"| {name} | {m['batches']:.3f} | {m['pad']:.3f} | {m['cut']:.3f} | {m['total']:.3f} |")
    if args.against:
        print(f"total: {medians[args.against]['total'] / medians['this tree']['total']:.1f}x faster")
    if args.json:
        args.json.write_text(json.dumps({"rows": args.rows, "tokens": tokens, "budget": args.budget,
                                         "repeats": args.repeats, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()

"""Training samples: the JSONL schema `filter` writes and `finetune` reads, and their statistics.

One JSON object per line:
    id            tape id, or `gold-train-00042` for a gold solution
    tape_id       the tape it came from (null for gold samples)
    problem_id    `train-00042`
    group_id      `i0003/train-00042` (iteration + problem: the advantage group); `gold/train-00042`
    iteration     sampling iteration (null for gold)
    model         model that sampled it (or whose tokenizer rendered a gold sample)
    input_ids     prompt + completion token ids exactly as sampled — never re-tokenised
    prompt_len    completion = input_ids[prompt_len:]; the loss covers only those tokens
    old_logprobs  sampler log-prob per completion token, or null
    ref_logprobs  reference log-prob per completion token, or null
    kl            implicit KL_i of the sample (Σ over its tokens), or null without a reference
    reward        task reward of the attempt (+1 correct, 0 wrong, −1 unparsable/cut)
    advantage     group advantage of the (KL-shaped) reward
    weight        w of the loss: advantage, or the shaped reward when use_advantages is false
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

from gsm8kctl.artifacts.jsonl import held_located, read_jsonl_located, shown
from gsm8kctl.artifacts.tapes import is_int_list, is_number, is_number_list
from gsm8kctl.errors import UserError

SAMPLE_KEYS = (
    "id", "tape_id", "problem_id", "group_id", "iteration", "model", "input_ids", "prompt_len",
    "old_logprobs", "ref_logprobs", "kl", "reward", "advantage", "weight",
)
REQUIRED_KEYS = ("id", "input_ids", "prompt_len", "reward", "weight")


def is_sample(record: dict) -> bool:
    """True for a training sample (filter output), as opposed to a tape."""
    return "input_ids" in record and "prompt_len" in record


# Samples files are read like any JSONL; the location travels with each record for later checks.
iter_jsonl_lines = read_jsonl_located


_is_int_list, _is_number = is_int_list, is_number


def check_sample(record: dict, where: str, *, seq_length: int | None = None,
                 vocab_size: int | None = None) -> dict:
    """Validate one sample (see the module docstring); errors name `file:line` and a remedy."""
    if not is_sample(record) and "completion_token_ids" in record:
        raise UserError(f"{where}: this is a tape, not a training sample; "
                        "turn tapes into samples with `gsm8kctl filter` first")
    missing = [k for k in REQUIRED_KEYS if k not in record]
    if missing:
        raise UserError(f"{where}: not a training sample (missing {', '.join(missing)})")
    sid = record["id"]
    if isinstance(sid, bool) or not isinstance(sid, (str, int)) or sid == "":
        raise UserError(f"{where}: id must be a non-empty string, got {shown(sid)}")
    ids, pl = record["input_ids"], record["prompt_len"]
    if not _is_int_list(ids) or not ids:
        raise UserError(f"{where}: input_ids must be a non-empty list of token ids")
    if not isinstance(pl, int) or isinstance(pl, bool) or not 1 <= pl < len(ids):
        raise UserError(f"{where}: prompt_len must be in 1..{len(ids) - 1} (len(input_ids) = {len(ids)}), "
                        f"got {shown(pl)}")
    n_comp = len(ids) - pl
    for key in ("old_logprobs", "ref_logprobs"):
        lp = record.get(key)
        if lp is None:
            continue
        if not isinstance(lp, list) or len(lp) != n_comp or not is_number_list(lp):
            raise UserError(f"{where}: {key} must hold {n_comp} numbers (one per completion token)")
    for key in ("reward", "weight"):
        if not _is_number(record[key]):
            raise UserError(f"{where}: {key} must be a finite number, got {shown(record[key])}")
    for key in ("advantage", "kl"):
        if record.get(key) is not None and not _is_number(record[key]):
            raise UserError(f"{where}: {key} must be a finite number or null, got {shown(record[key])}")
    if seq_length is not None and len(ids) > seq_length:
        raise UserError(f"{where}: sample {record['id']} has {len(ids)} tokens, more than "
                        f"finetune.seq_length={seq_length}; raise finetune.seq_length or "
                        "sample with a smaller max_tokens")
    if vocab_size is not None:
        top, low = max(ids), min(ids)
        if top >= vocab_size or low < 0:
            bad = low if low < 0 else top  # the id named is one that is out of range
            raise UserError(f"{where}: token id {bad} is outside the model's vocabulary "
                            f"(0..{vocab_size - 1}); were these samples made with another model?")
    return record


def read_samples(paths: Iterable[str | Path], *, seq_length: int | None = None,
                 vocab_size: int | None = None, given: list[dict] | None = None) -> list[dict]:
    """All samples of the given files (`-` = stdin), validated; an empty result is a UserError.
    `given`: the records of the one file in `paths`, already parsed by the caller that wrote them
    (the loop's filter phase): validated as read ones are, not read again."""
    paths = [str(p) for p in paths]
    if not paths:
        raise UserError("no samples file given")
    if given is not None and len(paths) != 1:
        raise ValueError("given stands for one samples file")
    out: list[dict] = []
    for path in paths:
        for where, record in iter_jsonl_lines(path) if given is None else held_located(path, given):
            out.append(check_sample(record, where, seq_length=seq_length, vocab_size=vocab_size))
    if not out:
        raise UserError(f"no training samples in {', '.join(paths)} (did filter keep nothing? "
                        "its table on stderr says why)")
    return out


# ---------------------------------------------------------------------------------------------
# Statistics (`stats` on a samples file, and finetune's dataset summary)


def _percentile(sorted_vals: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    k = max(0, min(len(sorted_vals) - 1, math.ceil(q / 100 * len(sorted_vals)) - 1))
    return sorted_vals[k]


def summary(values: list[float]) -> dict:
    """min/max/mean/p50/p90/p99 (None for an empty list)."""
    if not values:
        return {"min": None, "max": None, "mean": None, "p50": None, "p90": None, "p99": None}
    v = sorted(values)
    return {
        "min": v[0], "max": v[-1], "mean": round(sum(v) / len(v), 4),
        "p50": _percentile(v, 50), "p90": _percentile(v, 90), "p99": _percentile(v, 99),
    }


def samples_stats(samples: Iterable[dict]) -> dict:
    """Count, token lengths, reward/weight/advantage summary of samples; stable keys, streamed."""
    prompt, completion, total = [], [], []
    rewards, weights, advantages = [], [], []
    problems, groups = set(), set()
    with_old = with_ref = 0
    for s in samples:
        n = len(s["input_ids"])
        pl = s["prompt_len"]
        prompt.append(pl)
        completion.append(n - pl)
        total.append(n)
        rewards.append(float(s["reward"]))
        weights.append(float(s["weight"]))
        if s.get("advantage") is not None:
            advantages.append(float(s["advantage"]))
        problems.add(s.get("problem_id"))
        groups.add(s.get("group_id"))
        with_old += s.get("old_logprobs") is not None
        with_ref += s.get("ref_logprobs") is not None
    hist: dict[str, int] = {}
    for r in rewards:
        key = f"{r:g}"
        hist[key] = hist.get(key, 0) + 1
    return {
        "kind": "samples",
        "count": len(total),
        "problems": len(problems),
        "groups": len(groups),
        "prompt_tokens": summary(prompt),
        "completion_tokens": summary(completion),
        "total_tokens": summary(total),
        "completion_tokens_sum": sum(completion),
        "reward": {**summary(rewards), "histogram": dict(sorted(hist.items(), key=lambda kv: float(kv[0])))},
        "weight": {**summary(weights), "zero": sum(1 for w in weights if w == 0.0),
                   "negative": sum(1 for w in weights if w < 0.0)},
        "advantage": summary(advantages),
        "with_old_logprobs": with_old,
        "with_ref_logprobs": with_ref,
    }


def stats_table(stats: dict, title: str = "training samples"):
    """A rich Table of `samples_stats` (for stderr)."""
    from rich.table import Table

    def fmt(x) -> str:
        if x is None:
            return "-"
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    t = Table(title=title)
    for col in ("", "min", "mean", "p50", "p90", "max"):
        t.add_column(col, justify="right" if col else "left")
    for key in ("prompt_tokens", "completion_tokens", "total_tokens", "reward", "weight", "advantage"):
        d = stats[key]
        t.add_row(key, *(fmt(d[c]) for c in ("min", "mean", "p50", "p90", "max")))
    t.caption = (f"{stats['count']} samples, {stats['problems']} problems, {stats['groups']} groups, "
                 f"{stats['completion_tokens_sum']} completion tokens; reward histogram "
                 + ", ".join(f"{k}: {v}" for k, v in stats["reward"]["histogram"].items()))
    return t

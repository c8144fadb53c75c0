"""`stats`: what a tapes (or samples) file holds: counts, lengths, rewards, accuracy, pass@k."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from itertools import chain
from typing import Iterable, Iterator

from gsm8kctl.artifacts.tapes import check_tape, outcome, pass_at_k
from gsm8kctl.errors import UserError


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (q in 0..100)."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return float(sorted_values[k])


def length_summary(values: list[int]) -> dict:
    v = sorted(values)
    if not v:
        return {"min": 0, "max": 0, "mean": 0.0, "p50": 0, "p90": 0, "p99": 0}
    return {"min": v[0], "max": v[-1], "mean": round(sum(v) / len(v), 2),
            "p50": percentile(v, 50), "p90": percentile(v, 90), "p99": percentile(v, 99)}


def tape_stats(tapes: Iterable[dict]) -> dict:
    n = 0
    prompt_len, completion_len, total_len = [], [], []
    rewards: Counter = Counter()
    outcomes: Counter = Counter()
    strict = lenient = fmt = overflow = 0
    per_problem: dict[tuple, list[bool]] = defaultdict(list)
    for t in tapes:
        n += 1
        pl, cl = len(t.get("prompt_token_ids") or []), len(t.get("completion_token_ids") or [])
        prompt_len.append(pl)
        completion_len.append(cl)
        total_len.append(pl + cl)
        rewards[float(t.get("reward", 0.0))] += 1
        outcomes[outcome(t)] += 1
        ans = t.get("answer") or {}
        # A completion cut at max tokens is not correct, even with a right box: its reward is -1
        # (agent.grade), and accuracy must agree with the reward.
        cut = t.get("finish_reason") == "length"
        strict += bool(ans.get("correct_strict")) and not cut
        lenient += bool(ans.get("correct_lenient")) and not cut
        fmt += bool(ans.get("format"))
        overflow += cut
        per_problem[(t.get("iteration", 0), t.get("problem_id"))].append(bool(t.get("correct")) and not cut)
    result = {
        "kind": "tapes",
        "count": n,
        "problems": len(per_problem),
        "accuracy_strict": round(strict / n, 4) if n else 0.0,
        "accuracy_lenient": round(lenient / n, 4) if n else 0.0,
        "format_rate": round(fmt / n, 4) if n else 0.0,
        "overflow_rate": round(overflow / n, 4) if n else 0.0,
        "mean_reward": round(sum(r * c for r, c in rewards.items()) / n, 4) if n else 0.0,
        "reward_histogram": {str(r): c for r, c in sorted(rewards.items())},
        "outcomes": dict(sorted(outcomes.items())),
        "tokens": {"prompt": length_summary(prompt_len), "completion": length_summary(completion_len),
                   "total": length_summary(total_len)},
        "pass_at_k": {},
    }
    if per_problem:
        attempts = min(len(v) for v in per_problem.values())
        ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= attempts]
        if attempts not in ks:
            ks.append(attempts)
        for k in ks:
            vals = [pass_at_k(len(v), sum(v), k) for v in per_problem.values()]
            result["pass_at_k"][str(k)] = round(sum(vals) / len(vals), 4)
    return result


def is_samples_record(record: dict) -> bool:
    return "input_ids" in record and "completion_token_ids" not in record


def file_stats(records: Iterable[dict] | Iterable[tuple[str, dict]]) -> dict:
    """Stats of a tapes or a samples stream, told apart by the first record; every record checked.
    Tapes count once per id (`duplicate_ids` says how many repeats were left out).

    Records are dicts or (`file:line`, dict) pairs; a `read_jsonl` iterator names each line
    through its `where`. A record that is neither a tape nor a sample (or is the other kind) is a
    UserError naming its line and key, raised once the stream has been read to the end: a JSON
    syntax error further down is reported first, as it says more (not JSONL, or cut mid-write).
    """
    from gsm8kctl.artifacts.samples import check_sample, samples_stats

    it = iter(records)
    refused: list[UserError] = []

    def located() -> Iterator[tuple[str, dict]]:
        for n, item in enumerate(it, 1):
            yield item if isinstance(item, tuple) else (getattr(it, "where", f"record {n}"), item)

    def checked(pairs: Iterator[tuple[str, dict]], check) -> Iterator[dict]:
        for where, record in pairs:
            try:
                yield check(record, where)
            except UserError as exc:
                refused.append(exc)
                break
        for _ in pairs:  # the rest only for its syntax (see the docstring)
            pass

    pairs = located()
    head = next(pairs, None)
    if head is None:
        return {"kind": "empty", "count": 0}
    samples = is_samples_record(head[1])
    stream = checked(chain([head], pairs), check_sample if samples else check_tape)
    if samples:
        result = samples_stats(stream)
    else:
        duplicates = Counter()
        result = tape_stats(_first_of_each_id(stream, duplicates))
        result["duplicate_ids"] = duplicates["tapes"]
    if refused:
        raise refused[0]
    return result


def _first_of_each_id(tapes: Iterable[dict], dropped: Counter) -> Iterator[dict]:
    """Each tape id once, as filter and gather-tapes count them (a file concatenated twice, say)."""
    seen: set[str] = set()
    for t in tapes:
        if t["id"] in seen:
            dropped["tapes"] += 1
            continue
        seen.add(t["id"])
        yield t


def render_table(stats: dict, title: str) -> None:
    from rich.table import Table

    from gsm8kctl.progress import console

    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in stats.items():
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            for sub, summ in value.items():
                table.add_row(f"{key}.{sub}", " ".join(f"{k}={v}" for k, v in summ.items()))
        elif isinstance(value, dict):
            table.add_row(key, " ".join(f"{k}:{v}" for k, v in value.items()) or "-")
        elif isinstance(value, float):
            table.add_row(key, f"{value:.4f}")
        else:
            table.add_row(key, str(value))
    console.print(table)

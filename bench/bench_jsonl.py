"""What refusing non-finite numbers costs `read_jsonl`, against the JSON parse itself (CPU).

Every JSONL read (tapes, samples, calls) parses each line and checks it for NaN, Infinity and
numbers beyond float range (jsonl.py). This writes tape-like lines (text, 150 token ids and
log-probs each), then times per line, median of `--repeats`: the parse alone, the check as one
regex (before), and `maybe_nonfinite` (now). With `--against REV` it also times appending the
same records with `JsonlAppender` (what sample's writer does per tape) from this tree and from
gsm8kctl/artifacts/jsonl.py at REV, alternating. Prints a table and writes JSON.

    python bench/bench_jsonl.py --lines 4096 --out bench-jsonl.json
    python bench/bench_jsonl.py --lines 4096 --against c2ac759 --out bench-jsonl-append.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench-jsonl.json")
    ap.add_argument("--against", help="a git revision whose JsonlAppender to time beside this tree's")
    a = ap.parse_args()

    from gsm8kctl.artifacts.jsonl import maybe_nonfinite

    one_regex = re.compile(r"NaN|Infinity|[eE]\+?[0-9]{3}|[0-9]{300}")  # the check before
    rng = random.Random(0)
    lines = [json.dumps({"id": f"tape-{i}", "prompt": "Janet's ducks lay 16 eggs per day. " * 8,
                         "completion": "She eats 3 for breakfast and bakes 4 into muffins. " * 10,
                         "completion_token_ids": [rng.randrange(49152) for _ in range(150)],
                         "logprobs": [-rng.expovariate(3.0) for _ in range(150)], "reward": 1.0})
             for i in range(a.lines)]
    ways = {"json.loads": json.loads, "one regex (before)": one_regex.search, "maybe_nonfinite (now)": maybe_nonfinite}
    per_line_us = {}
    for name, fn in ways.items():
        runs = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for line in lines:
                fn(line)
            runs.append((time.perf_counter() - t0) / len(lines) * 1e6)
        per_line_us[name] = statistics.median(runs)
    parse = per_line_us["json.loads"]
    print(f"{a.lines} lines of {statistics.mean(map(len, lines)):.0f} characters")
    print("| per line | µs (median of %d) | × the parse |" % a.repeats)
    print("|---|---|---|")
    for name, us in per_line_us.items():
        print(f"| {name} | {us:.1f} | {us / parse:.2f} |")
    append_us = time_appends(lines, a.against, a.repeats) if a.against else {}
    for name, us in append_us.items():
        print(f"| append, JsonlAppender of {name} | {us:.1f} | {us / parse:.2f} |")
    with open(a.out, "w") as f:
        json.dump({"lines": a.lines, "per_line_us": per_line_us, "append_per_line_us": append_us}, f, indent=1)


def time_appends(lines: list[str], rev: str, repeats: int) -> dict:
    """µs per record appended (serialised and written, fsync every 64 as in use), median of
    `repeats`, this tree and `rev` alternating, each into a fresh file."""
    import gsm8kctl.artifacts.jsonl as now
    from module_at import module_at

    modules = {"this tree": now, rev: module_at(rev, "gsm8kctl/artifacts/jsonl.py")}
    records = [json.loads(line) for line in lines]
    runs: dict[str, list[float]] = {name: [] for name in modules}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for name, mod in modules.items():
                path = Path(tmp) / f"{r}-{len(runs[name])}-{name[:8]}.jsonl"
                t0 = time.perf_counter()
                with mod.JsonlAppender(path) as w:
                    for rec in records:
                        w.write(rec)
                runs[name].append((time.perf_counter() - t0) / len(records) * 1e6)
                path.unlink()
    return {name: statistics.median(v) for name, v in runs.items()}


if __name__ == "__main__":
    main()

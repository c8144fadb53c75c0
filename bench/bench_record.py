"""Where the loop's record phase spends its host time (CPU, no model), and what drawing the
learning curve only when an evaluation lands saves over a run.

Builds `--tapes` tape-like records as bench_check_records.py does (256 problems of 16 attempts for
4096; about 40 % of the problems with one rewarded attempt) and a metrics file of `--iterations`
rows (evaluated every `--every`), then times, median of `--repeats`, each part of the record
phase: the tape statistics, the uniform-group and duplicate counts, the samples' fingerprint (to
find their finetune steps), the pass-rate table's rewrite, the metrics file's rewrite, and the
learning curve's drawing. The run total multiplies the curve by the iterations that draw it: all of
them before, the evaluated ones and the last now (`curve_due`). Prints a table and writes JSON.

    python bench/bench_record.py --out record.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tapes", type=int, default=4096)
    ap.add_argument("--iterations", type=int, default=48, help="the run's iterations (the default's GPU sizes: 48)")
    ap.add_argument("--every", type=int, default=4, help="test_every_n_iterations (the default's GPU sizes: 4)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="record.json")
    a = ap.parse_args()
    if a.tapes < 16 or a.iterations < 1 or a.every < 1 or a.repeats < 1:
        ap.error("--tapes must be >= 16, and --iterations, --every and --repeats >= 1")

    from bench_check_records import records

    from gsm8kctl.artifacts.jsonl import write_jsonl
    from gsm8kctl.loop.curriculum import record_pass_rates
    from gsm8kctl.loop.driver import _duplicate_correct, _uniform_groups, curve_due, plot_learning_curve
    from gsm8kctl.stages.stats import tape_stats
    from gsm8kctl.training.trainer import fingerprint

    tapes, samples = records(a.tapes)
    rng = random.Random(1)
    for start in range(0, len(tapes), 16):
        if rng.random() < 0.4:
            tapes[start]["reward"], tapes[start]["correct"] = 1.0, True
    # The filter keeps the groups with a rewarded attempt (uniform groups dropped): all 16 of each.
    kept = [s for i, s in enumerate(samples) if tapes[i - i % 16]["correct"]]
    rows = []
    for it in range(-1, a.iterations + 1):
        row = {"iteration": it, "train_success_rate": round(0.03 + 0.0008 * it, 4) if it >= 0 else None}
        if it == -1 or it % a.every == 0 or it == a.iterations:
            acc = 0.05 + 0.001 * it
            row.update(test_accuracy_strict=acc, test_accuracy_lenient=acc + 0.01, validation_accuracy_strict=acc,
                       test_format_rate=0.9)
        rows.append(row)
    tmp = Path(tempfile.mkdtemp())
    parts = {
        "tape statistics (`tape_stats`)": lambda: tape_stats(tapes),
        "uniform groups and duplicate correct completions": lambda: (_uniform_groups(tapes), _duplicate_correct(tapes)),
        f"fingerprint of {len(kept)} samples": lambda: fingerprint(kept),
        "pass-rate table rewritten": lambda: record_pass_rates(tmp / "pass_rates.jsonl", 3, tapes, {}),
        f"metrics file of {len(rows)} rows rewritten": lambda: write_jsonl(tmp / "metrics.jsonl", rows),
        f"learning curve of {len(rows)} rows drawn": lambda: plot_learning_curve(rows, tmp / "learning_curve.png"),
    }
    plot_learning_curve(rows, tmp / "warm.png")  # matplotlib's first import and font cache, not a record's cost
    times = {name: [] for name in parts}
    for _ in range(a.repeats):
        for name, fn in parts.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(v) for name, v in times.items()}
    curve = med[f"learning curve of {len(rows)} rows drawn"]
    rest = sum(med.values()) - curve
    trained = [r for r in rows if r["iteration"] >= 0]
    drawn_before = len(trained)
    drawn_now = sum(curve_due(r, a.iterations) for r in trained)
    out = {"tapes": a.tapes, "iterations": a.iterations, "every": a.every, "repeats": a.repeats,
           "parts_s": {k: round(v, 4) for k, v in med.items()},
           "record_s_per_iteration": {"without the curve": round(rest, 4), "with the curve": round(rest + curve, 4)},
           "curve_drawn": {"before (every iteration)": drawn_before, "now (curve_due)": drawn_now},
           "run_record_s": {"before": round(drawn_before * (rest + curve), 2),
                            "now": round(drawn_before * rest + drawn_now * curve, 2)}}
    print(f"{'part of the record phase':<56} {'s':>7}")
    for k, v in med.items():
        print(f"{k:<56} {v:>7.4f}")
    print(f"\nover a run of {a.iterations} iterations evaluated every {a.every}: the curve drawn {drawn_before} "
          f"times before, {drawn_now} now; record phases {out['run_record_s']['before']} s -> "
          f"{out['run_record_s']['now']} s")
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

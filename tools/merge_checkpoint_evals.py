"""Put evaluations made afterwards on a run's checkpoints into its metrics.jsonl, where the loop
would have recorded them, so `tools/results_report.py` draws them on the run's curve.

    python tools/merge_checkpoint_evals.py RUN/metrics.jsonl EVALS.txt --start START_EVAL.jsonl \
        --out RUN2/metrics.jsonl

A run trained with `test_every_n_iterations=0` (no evaluation inside the loop) can be evaluated
checkpoint by checkpoint later, each with `gsm8kctl loop --model CKPT --run-dir EV iterations=0`.
EVALS.txt holds one line per such evaluation: the checkpoint name (`step-000080`), a space, and
the last line of EV/metrics.jsonl. The checkpoint at the end of iteration i is the one iteration
i + 1 starts from, so its test figures go into row i + 1, as an in-loop evaluation at the start of
that iteration (a row past the last iteration is added). The step at the end of each iteration is
the running sum of `train_steps`. `--start` gives the evaluation of the starting model (row 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KEYS = ("test_accuracy_strict", "test_accuracy_lenient", "test_format_rate", "test_n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("metrics", type=Path)
    ap.add_argument("evals", type=Path, nargs="+")
    ap.add_argument("--start", type=Path, help="metrics.jsonl whose last line evaluates the starting model")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["iteration"])
    step_after, total = {}, 0
    for r in rows:
        total += int(r.get("train_steps") or 0)
        step_after[total] = r["iteration"]
    by_iteration = {r["iteration"]: r for r in rows}

    def put(it: int, ev: dict) -> None:
        row = by_iteration.setdefault(it, {"iteration": it, "seconds": {}})
        row.update({k: ev.get(k) for k in KEYS})
        row.setdefault("seconds", {})["evaluate"] = ev.get("seconds", {}).get("evaluate", 0.0)
        row["evaluated_after_the_run"] = ev.get("model")

    if args.start:
        put(0, json.loads(args.start.read_text().splitlines()[-1]))
    for path in args.evals:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            name, payload = line.split(" ", 1)
            step = int(name.removeprefix("step-"))
            if step not in step_after:
                sys.exit(f"{path}: {name} is not the checkpoint at the end of an iteration")
            put(step_after[step] + 1, json.loads(payload))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(by_iteration[i]) + "\n" for i in sorted(by_iteration)))
    print(f"{args.out}: {sum(1 for r in by_iteration.values() if r.get('test_accuracy_strict') is not None)} evaluations")
    return 0


if __name__ == "__main__":
    sys.exit(main())

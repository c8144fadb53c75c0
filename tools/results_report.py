"""The results table and learning-curve plot of several loop runs, from their metrics.jsonl.

    python tools/results_report.py runs/rs=rejection runs/reinforce=REINFORCE runs/grpo=GRPO \
        --reference "base zero-shot=runs/base0/metrics.json" --plot docs/results.png --json docs/results.json

Each RUN[=LABEL] is a loop run directory. Per run, one table row:
- test strict accuracy of the checkpoint chosen on validation (the evaluation with the best
  validation strict, the earliest of equals, as the loop keeps it), with its iteration: the figure
  to report;
- test strict and lenient accuracy at the last evaluation and at the best one (by test strict:
  chosen on the test set, so biased upwards), with the iteration of the best, and the mean strict
  over every evaluation after the first;
- wall time: the sum of every recorded phase's seconds (state.json timings), warm start excluded
  (it is shared by runs that start from the same checkpoint), and the same up to the best;
- samples used: attempts sampled and samples trained, summed over the iterations;
- test strict at iteration 0 (after the warm start, before any RL) and the chosen checkpoint's
  ratio to it.

`--phases FROM:TO` adds a second table: per run, the median over iterations FROM..TO of each timed
phase of an iteration (sample, filter, finetune; evaluations excluded), their sum, recording and
the wait for the background checkpoint save (state.json timings), the mean completion length and
the sampled tokens per second (attempts × mean completion tokens / sample seconds), and where
the loop ran its sampler in process on the slot engine, its decode steps and the rows busy in an
average step against its slots (`sampler` in metrics.jsonl; a low fill is a tail of a few long
attempts): the figures behind docs/benchmarks.md's per-phase tables.

`--until N` reads each run up to iteration N only: runs of different lengths compared at one
budget. `--reference LABEL=PATH` adds a row from an `evaluate` metrics.json (the base model
zero-shot, 4-shot, ...). The plot has one panel per curve (test and validation strict, test
lenient, train success, pass@k, mean KL to the reference, mean entropy, mean completion length)
against cumulative wall time, one line per run. The markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

CURVES = (("test_accuracy_strict", "test strict"), ("validation_accuracy_strict", "validation strict"),
          ("test_accuracy_lenient", "test lenient"),
          ("train_success_rate", "train success"), ("pass_at_k", "train pass@k (k = attempts)"),
          ("train_kl_mean", "KL to reference (mean per step)"), ("train_entropy_mean", "entropy (mean per step)"),
          ("mean_output_tokens", "mean completion tokens"))


def load_run(path: Path, label: str, until: int | None = None) -> dict:
    rows = [json.loads(line) for line in open(path / "metrics.jsonl", encoding="utf-8")]
    rows = sorted((r for r in rows if until is None or r["iteration"] <= until), key=lambda r: r["iteration"])
    # An iteration evaluates first, then samples and trains: its test point is at the end of its
    # evaluate, its train point at the end of the iteration (weights_refresh is inside finetune).
    elapsed, eval_elapsed, t = [], [], 0.0
    for r in rows:
        secs = r.get("seconds", {})
        eval_elapsed.append(round(t + secs.get("evaluate", 0.0), 1))
        t += sum(v for k, v in secs.items() if k != "weights_refresh")
        elapsed.append(round(t, 1))
    evals = [(r, e) for r, e in zip(rows, eval_elapsed) if r.get("test_accuracy_strict") is not None]
    out = {"label": label, "run": str(path), "rows": rows, "elapsed_s": elapsed, "eval_elapsed_s": eval_elapsed,
           "attempts": sum(r.get("attempts", 0) for r in rows),
           "samples_trained": sum(r.get("samples_kept", 0) for r in rows), "wall_s": elapsed[-1] if rows else 0}
    if evals:
        last, _ = evals[-1]
        best, best_t = max(evals, key=lambda x: (x[0]["test_accuracy_strict"], -x[0]["iteration"]))
        out.update(final_strict=last["test_accuracy_strict"], final_lenient=last.get("test_accuracy_lenient"),
                   best_strict=best["test_accuracy_strict"], best_lenient=best.get("test_accuracy_lenient"),
                   best_iteration=best["iteration"], best_wall_s=best_t, test_n=last.get("test_n"))
    started = [r for r, _ in evals if r["iteration"] >= 0]  # iteration -1: the model before its warm start
    if started:
        out["start_strict"] = started[0]["test_accuracy_strict"]
    validated = [r for r, _ in evals if r.get("validation_accuracy_strict") is not None]
    if validated:  # max() keeps the first of equals: the earliest, as the loop keeps its best
        chosen = max(validated, key=lambda r: r["validation_accuracy_strict"])
        out.update(chosen_strict=chosen["test_accuracy_strict"], chosen_iteration=chosen["iteration"],
                   chosen_validation=chosen["validation_accuracy_strict"])
    state = path / "state.json"
    out["timings"] = json.loads(state.read_text(encoding="utf-8")).get("timings", {}) if state.exists() else {}
    if len(evals) > 1:  # one evaluation is noisy (0.6 points at 5 % on 1319): the mean over the run
        out["mean_strict"] = sum(r["test_accuracy_strict"] for r, _ in evals[1:]) / (len(evals) - 1)
    return out


def value(row: dict, key: str):
    """A curve's value in one metrics row; pass_at_k is {k: rate}: its largest k."""
    v = row.get(key)
    if isinstance(v, dict):
        v = v[max(v, key=int)] if v else None
    return v


def pct(v) -> str:
    return "–" if v is None else f"{v * 100:.2f} %"


def table(runs: list[dict], references: list[tuple[str, dict]]) -> str:
    lines = ["| method | chosen on validation: test strict (iteration) | test strict (end) | test lenient (end) | "
             "best strict (iteration) | best lenient | mean strict after the first | test strict at iteration 0 | "
             "chosen ÷ iteration 0 | wall time | to best | attempts sampled | samples trained |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, m in references:
        lines.append(f"| {label} | – | {pct(m['accuracy_strict'])} | {pct(m['accuracy_lenient'])} | – | – | – | – | – | "
                     f"{m.get('seconds', 0):.0f} s (eval) | – | – | – |")
    for r in runs:
        ratio = f"{r['chosen_strict'] / r['start_strict']:.2f}×" if r.get("start_strict") and "chosen_strict" in r else "–"
        best = f"{pct(r.get('best_strict'))} ({r.get('best_iteration', '–')})"
        chosen = f"{pct(r['chosen_strict'])} ({r['chosen_iteration']})" if "chosen_strict" in r else "–"
        lines.append(f"| {r['label']} | {chosen} | {pct(r.get('final_strict'))} | {pct(r.get('final_lenient'))} | {best} | "
                     f"{pct(r.get('best_lenient'))} | {pct(r.get('mean_strict'))} | {pct(r.get('start_strict'))} | {ratio} | {r['wall_s'] / 60:.1f} min | "
                     f"{r.get('best_wall_s', 0) / 60:.1f} min | {r['attempts']} | {r['samples_trained']} |")
    return "\n".join(lines)


PHASES = ("sample", "filter", "finetune")


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def phase_table(runs: list[dict], first: int, last: int) -> tuple[str, list[dict]]:
    """Per run, medians over iterations first..last of the timed phases (evaluations excluded)."""
    lines = ["| run | iterations | " + " | ".join(PHASES) + " | sum of the timed phases | record | "
             "checkpoint wait | completion tokens | sampled tokens/s | decode steps | busy rows / slots |",
             "|---|---|" + "---|" * (len(PHASES) + 7)]
    out = []
    for r in runs:
        rows = [row for row in r["rows"] if first <= row["iteration"] <= last and
                all(p in row.get("seconds", {}) for p in PHASES)]
        extra = [r["timings"].get(str(row["iteration"]), {}) for row in rows]
        med = {p: median([row["seconds"][p] for row in rows]) for p in PHASES}
        med["sum"] = median([sum(row["seconds"][p] for p in PHASES) for row in rows])
        for key in ("record", "checkpoint_wait"):
            med[key] = median([t[key] for t in extra if key in t])
        med["completion_tokens"] = median([row["mean_output_tokens"] for row in rows if "mean_output_tokens" in row])
        med["sampled_tokens_per_s"] = median([row["attempts"] * row["mean_output_tokens"] / row["seconds"]["sample"]
                                              for row in rows if row.get("attempts") and row["seconds"]["sample"]])
        counters = [row["sampler"] for row in rows if row.get("sampler")]  # the slot engine's, in process
        med["decode_steps"] = median([c["decode_steps"] for c in counters])
        med["busy_rows"] = median([c["mean_busy_rows"] for c in counters])
        slots = median([c["slots"] for c in counters])
        iters = f"{rows[0]['iteration']}–{rows[-1]['iteration']} ({len(rows)})" if rows else "none"
        cells = ["–" if med[k] is None else f"{med[k]:.2f}" for k in (*PHASES, "sum", "record", "checkpoint_wait")]
        cells.append("–" if med["completion_tokens"] is None else f"{med['completion_tokens']:.0f}")
        cells.append("–" if med["sampled_tokens_per_s"] is None else f"{med['sampled_tokens_per_s'] / 1000:.1f} k")
        cells.append("–" if med["decode_steps"] is None else f"{med['decode_steps']:.0f}")
        cells.append("–" if med["busy_rows"] is None else f"{med['busy_rows']:.0f} / {slots:.0f}")
        lines.append(f"| {r['label']} | {iters} | " + " | ".join(cells) + " |")
        out.append({"label": r["label"], "iterations": [row["iteration"] for row in rows], "median_s": med})
    return "\n".join(lines), out


def plot(runs: list[dict], references: list[tuple[str, dict]], path: Path, x: str = "wall") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(15, 11))
    for ax, (key, title) in zip(axes.flat, CURVES):
        for i, r in enumerate(runs):
            times = r["eval_elapsed_s"] if key.startswith("test_") else r["elapsed_s"]
            xs = [row["iteration"] for row in r["rows"]] if x == "iteration" else [t / 60 for t in times]
            pts = [(at, value(row, key)) for row, at in zip(r["rows"], xs) if value(row, key) is not None]
            # One colour per run in every panel, also where a run has no such curve (the SFT control).
            ax.plot(*(zip(*pts) if pts else ([], [])), "o-", ms=3, color=f"C{i}", label=r["label"])
        if key.startswith("test_accuracy"):
            src = "accuracy_strict" if key.endswith("strict") else "accuracy_lenient"
            for label, m in references:
                ax.axhline(m[src], ls=":", lw=1, color="grey")
                ax.annotate(label, (0, m[src]), fontsize=7, color="grey", va="bottom")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("iteration" if x == "iteration" else "wall time (min, warm start excluded)", fontsize=8)
        ax.grid(alpha=0.3)
    axes.flat[-1].axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    axes.flat[-1].legend(handles, labels, loc="center")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="RUN_DIR or RUN_DIR=LABEL")
    ap.add_argument("--reference", action="append", default=[], help="LABEL=PATH/metrics.json of an evaluate run")
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--x", choices=("wall", "iteration"), default="wall",
                    help="the plot's x axis: wall time, or iteration (runs that shared a GPU)")
    ap.add_argument("--until", type=int, help="read each run up to this iteration only (one budget for all)")
    ap.add_argument("--phases", metavar="FROM:TO", help="also tabulate each run's median phase seconds over these iterations")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    span = None
    if args.phases:
        parts = args.phases.split(":")
        try:
            span = (int(parts[0]), int(parts[1])) if len(parts) == 2 else None
        except ValueError:
            span = None
        if span is None or span[0] > span[1]:
            print(f"results_report.py: --phases: FROM:TO with FROM <= TO, got {args.phases!r}", file=sys.stderr)
            sys.exit(2)
    runs = []
    for spec in args.runs:
        path, _, label = spec.partition("=")
        runs.append(load_run(Path(path), label or Path(path).name, args.until))
    references = []
    for spec in args.reference:
        label, _, path = spec.partition("=")
        references.append((label, json.loads(Path(path).read_text(encoding="utf-8"))))
    print(table(runs, references))
    phases = None
    if span:
        text, phases = phase_table(runs, *span)
        print()
        print(text)
    if args.plot:
        plot(runs, references, args.plot, args.x)
    if args.json:
        args.json.write_text(json.dumps({"runs": [{k: v for k, v in r.items() if k not in ("rows", "timings")}
                                                  for r in runs],
                                         "references": dict(references), "phases": phases}, indent=1))


if __name__ == "__main__":
    main()

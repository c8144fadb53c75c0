"""Iteration time of `gsm8kctl loop`, in-process engine vs child processes, side by side.

    python bench/bench_loop_engine.py --model TINY_DIR --attempts 2 --forks 16 --iterations 3 \
        --max-tokens 32 --out ble.json use_rejection_sampling=false \
        finetune.rl.use_advantages=false                                 # CPU check (random tiny model)
    python bench/bench_loop_engine.py --model smollm2-135m --attempts 8 --forks 4096 --iterations 3 \
        --max-tokens 512 --out ble.json                                  # the real model, one GPU

For each engine (`loop.engine=inprocess`, then `processes`) this runs the real `gsm8kctl loop`
as a subprocess on a fresh run directory with the same config and no evaluation
(`test_every_n_iterations=0`), then reads the run's `metrics.jsonl` (per-phase seconds, as the
loop records them) and `finetune/metrics.jsonl` (per-step `time_s`). Reported per engine:
median iteration seconds (the sum of sample, filter and finetune of iterations >= 1; iteration 0 pays the
one-time start: model load, compile, CUDA graph capture), iteration 0 seconds, median phase
seconds (evaluation, when an override turns it on, is in each iteration's `evaluate_s` and the wall time), finetune overhead (the finetune phase minus its optimizer steps: start, load, the
checkpoint save, the weights refresh), and the whole loop wall time. Extra `key=value`
arguments go to both loops unchanged. Markdown table on stdout, JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASES = ("sample", "filter", "finetune")


def run_loop(engine: str, args, overrides: list[str], workdir: Path) -> dict:
    # Both engines run at the same path, renamed after: the seeds hash the model's path (a checkpoint
    # in the run directory), so only then can their tapes be compared attempt for attempt.
    run_dir, kept = workdir / "run", workdir / f"run-{engine}"
    if kept.exists():
        sys.exit(f"{kept} exists: give an empty --workdir")
    cmd = [sys.executable, "-m", "gsm8kctl", "loop", "--model", args.model, "--run-dir", str(run_dir),
           "--iterations", str(args.iterations), "--attempts", str(args.attempts), "--backend", "transformers",
           f"max_agent_forks={args.forks}", f"sampling.max_tokens={args.max_tokens}",
           "test_every_n_iterations=0", f"loop.engine={engine}", "--quiet", *overrides]
    print(f"[{engine}] {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"[{engine}] loop failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    trained = [r for r in rows if r["iteration"] < args.iterations]
    fdir = run_dir / "finetune"  # absent when no iteration kept a sample
    steps = [json.loads(line) for line in open(fdir / "metrics.jsonl")] if (fdir / "metrics.jsonl").exists() else []
    step_s: dict[str, float] = {}
    for s in steps:  # each finetune phase's lines carry its samples' fingerprint
        step_s[s["phase"]] = step_s.get(s["phase"], 0.0) + s["time_s"]
    it_of = {}  # fingerprint -> iteration, from the phase's source (RUN/iterations/NNNN/samples.jsonl)
    for line in (open(fdir / "dataset_stats.jsonl") if steps else []):
        d = json.loads(line)
        src = Path(d["sources"][0]) if d.get("sources") else None
        if src is not None and src.parent.parent.name == "iterations":
            it_of[d["phase"]] = int(src.parent.name)
    steps_of = {it_of[fp]: secs for fp, secs in step_s.items() if fp in it_of}
    per_it = []
    for r in trained:
        secs, phase_steps = r["seconds"], steps_of.get(r["iteration"], 0.0)
        per_it.append({
            "iteration": r["iteration"],
            "total_s": round(sum(secs.get(p, 0.0) for p in PHASES), 2),
            **{f"{p}_s": secs.get(p) for p in PHASES}, "evaluate_s": secs.get("evaluate"),
            "optimizer_steps_s": round(phase_steps, 3),
            "finetune_overhead_s": round(secs.get("finetune", 0.0) - phase_steps, 2),
            "weights_refresh_s": secs.get("weights_refresh"),
            # In-process: how long the sample phase waited at its end for the background checkpoint write.
            "checkpoint_wait_s": secs.get("checkpoint_wait"),
            "attempts": r.get("attempts"), "sample_tokens_per_s": r.get("sample_tokens_per_s"),
        })
    later = per_it[1:] or per_it
    def med(key: str) -> float | None:  # `record` writes the row, so its own time is never in it
        values = [x[key] for x in later if x[key] is not None]
        return round(statistics.median(values), 2) if values else None

    run_dir.rename(kept)
    return {"engine": engine, "run_dir": str(kept), "wall_s": round(wall, 1), "iterations": per_it,
            "iteration0_s": per_it[0]["total_s"] if per_it else None,
            "median_iteration_s": med("total_s"), "median_finetune_overhead_s": med("finetune_overhead_s"),
            **{f"median_{p}_s": med(f"{p}_s") for p in PHASES}}


def same_tapes(run_a: Path, run_b: Path) -> dict:
    """Per tapes file in both runs: the share of attempts with the same completion tokens and reward.
    On the CPU in float32 the engines agree bit for bit (tests/test_loop.py); on a GPU in bfloat16
    this shows how far the in-place weights refresh and the reloaded checkpoint agree."""
    from gsm8kctl.artifacts.jsonl import read_jsonl

    shares = {}
    for tapes in sorted(run_a.glob("*/*/tapes.jsonl")):
        other = run_b / tapes.relative_to(run_a)
        if not other.exists():
            continue
        key = lambda t: (t["problem_id"], t["attempt"])  # noqa: E731
        theirs = {key(t): (t["completion_token_ids"], t["reward"]) for t in read_jsonl(other)}
        ours = [(key(t), (t["completion_token_ids"], t["reward"])) for t in read_jsonl(tapes)]
        same = sum(theirs.get(k) == v for k, v in ours)
        shares[str(tapes.parent.relative_to(run_a))] = round(same / max(len(ours), 1), 4)
    return shares


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--attempts", type=int, default=8)
    ap.add_argument("--forks", type=int, default=4096, help="max_agent_forks: attempts per iteration")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--engines", default="inprocess,processes")
    ap.add_argument("--workdir", type=Path, help="keep the run directories here (default: a temp dir)")
    ap.add_argument("--out", type=Path)
    args, overrides = ap.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = [run_loop(e, args, overrides, workdir) for e in args.engines.split(",")]
        identical = same_tapes(Path(results[0]["run_dir"]), Path(results[1]["run_dir"])) if len(results) == 2 else {}
    print("| engine | median iteration s (it ≥ 1) | iteration 0 s | sample s | filter s | finetune s | "
          "finetune overhead s | loop wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['engine']} | {r['median_iteration_s']} | {r['iteration0_s']} | {r['median_sample_s']} | "
              f"{r['median_filter_s']} | {r['median_finetune_s']} | {r['median_finetune_overhead_s']} | "
              f"{r['wall_s']} |")
    if len(results) == 2:
        print(f"\nratio {results[1]['engine']} / {results[0]['engine']} (median iteration): "
              f"{results[1]['median_iteration_s'] / max(results[0]['median_iteration_s'], 1e-9):.2f}x")
    if identical:
        print("\nattempts with the same tokens and reward in both runs: "
              + ", ".join(f"{k} {v:.1%}" for k, v in identical.items()))
    if args.out:
        args.out.write_text(json.dumps({"args": {**vars(args), "workdir": str(args.workdir), "out": str(args.out)},
                                        "overrides": overrides, "results": results,
                                        "same_tapes": identical}, indent=1))


if __name__ == "__main__":
    main()

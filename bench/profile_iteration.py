"""Where one loop iteration's wall time goes, phase by phase: the device busy or the host alone.

    python bench/profile_iteration.py --run-dir DIR --iterations 3 --profile-iteration 2 \
        --out iteration.json model=MODEL                      # one GPU, the default config's sizes
    python bench/profile_iteration.py --run-dir DIR --iterations 2 --profile-iteration 1 \
        --out iteration.json model=TINY machine=cpu backend=transformers loop.engine=inprocess ...
                                                              # CPU check (no device activity to see)

Runs the real loop in this process (`gsm8kctl loop` with the `key=value` arguments given; the
in-process engine, as `auto` picks on one CUDA device, so that every phase runs here), and
records iteration `--profile-iteration` under torch.profiler, each phase (evaluate, sample,
filter, finetune, record) in its own labelled range. Earlier iterations pay the one-time costs
(model load, compile, CUDA graph capture) outside the profile, and the iteration before the
profiled one gives each phase's unprofiled wall time beside it, so the profiler's own overhead
shows.

Per phase: wall seconds (profiled and unprofiled), the seconds at least one GPU kernel or copy
ran (the union of their intervals), the share of the wall that is, how many kernels and copies
ran, and the host-only seconds (wall minus device busy: Python, launches, syncs, file work).
Then the CPU operators with the most self time in the profiled iteration. A markdown table on
stdout, JSON to --out, the Chrome trace to --trace if given. A run directory that exists is
resumed, as `loop` resumes it: give a fresh one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PHASES = ("evaluate", "sample", "filter", "finetune", "record")
RANGE = "phase:"


def union_seconds(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of [start, end) intervals (µs) clipped to [lo, hi), in seconds."""
    clipped = sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in clipped:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1e6


def analyse(prof, unprofiled: dict) -> dict:
    """Phase windows from the labelled CPU ranges; device activity from the kernel and copy events."""
    from torch.autograd import DeviceType

    windows, device = {}, []
    for e in prof.events():
        if e.name.startswith(RANGE) and e.device_type == DeviceType.CPU:
            windows[e.name[len(RANGE):]] = (e.time_range.start, e.time_range.end)
        elif e.device_type == DeviceType.CUDA:
            device.append((e.time_range.start, e.time_range.end, e.name))
    rows = []
    for phase in PHASES:
        if phase not in windows:
            continue
        lo, hi = windows[phase]
        inside = [(s, e) for s, e, _ in device if e > lo and s < hi]
        copies = sum(1 for s, e, n in device if e > lo and s < hi and "memcpy" in n.lower())
        wall = (hi - lo) / 1e6
        busy = union_seconds(inside, lo, hi)
        rows.append({"phase": phase, "wall_s": round(wall, 3), "unprofiled_wall_s": unprofiled.get(phase),
                     "device_busy_s": round(busy, 3), "device_busy_share": round(busy / wall, 3) if wall else None,
                     "kernels": len(inside) - copies, "copies": copies, "host_only_s": round(wall - busy, 3)})
    return {"phases": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True, help="a fresh directory for the loop run")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--profile-iteration", type=int, default=2, help="the iteration to profile (>= 1)")
    ap.add_argument("--out", type=Path, help="JSON results")
    ap.add_argument("--trace", type=Path, help="Chrome trace of the profiled iteration")
    ap.add_argument("--top", type=int, default=15, help="CPU operators listed by self time")
    ap.add_argument("overrides", nargs="*", help="key=value, as for `gsm8kctl loop`")
    args = ap.parse_args()
    k = args.profile_iteration
    if not 1 <= k < args.iterations:
        ap.error("--profile-iteration must be at least 1 and below --iterations (the last only evaluates)")

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from gsm8kctl.config import load_config
    from gsm8kctl.errors import UserError
    from gsm8kctl.loop import driver
    from gsm8kctl.loop.engine import choose_engine

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    held: dict = {}

    def wrap(phase: str):
        method = getattr(driver._Context, f"_{phase}")

        def timed(self, it: int):
            if it != k:
                return method(self, it)
            if "prof" not in held:  # the first phase of the profiled iteration starts the profiler
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                held["prof"] = profile(activities=activities)
                held["prof"].__enter__()
                held["t0"] = time.perf_counter()
            with record_function(RANGE + phase):
                out = method(self, it)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # the phase's device work ends inside its range
            if phase == "record":
                held["wall_s"] = time.perf_counter() - held["t0"]
                held["prof"].__exit__(None, None, None)
                held["state"] = self.state
            return out
        setattr(driver._Context, f"_{phase}", timed)

    for phase in PHASES:
        wrap(phase)
    sizes: dict = {}
    cfg = load_config(None, [f"iterations={args.iterations}", *args.overrides], command="loop", sizes_chosen=sizes)
    engine, why = choose_engine(cfg)
    if engine != "inprocess":  # a phase in a child process would leave nothing in this profile
        raise UserError(f"the phases must run in this process to be profiled, and here they would not ({why}): "
                        "add loop.engine=inprocess")
    report = os.fdopen(os.dup(1), "w")  # the loop sends fd 1 to RUN/output.log from its start
    driver.loop(cfg, str(args.run_dir), quiet=True, sizes=sizes, library_log=True)
    if "prof" not in held or "wall_s" not in held:
        sys.exit(f"iteration {k} did not run in full (a resumed run directory past it?): give a fresh --run-dir")
    prof = held["prof"]
    timings = json.loads((args.run_dir / "state.json").read_text(encoding="utf-8"))["timings"]
    unprofiled = {p: v for p, v in timings.get(str(k - 1), {}).items() if p in PHASES}
    result = analyse(prof, unprofiled)
    result.update(iteration=k, wall_s=round(held["wall_s"], 3), device=torch.cuda.get_device_name(0)
                  if torch.cuda.is_available() else "cpu", overrides=args.overrides, torch=torch.__version__)
    ops = [e for e in prof.key_averages() if not e.key.startswith(RANGE)]
    result["top_cpu_ops"] = [{"name": e.key, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 3), "calls": e.count}
                             for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:args.top]]
    if args.trace:
        prof.export_chrome_trace(str(args.trace))

    out = [f"iteration {k} on {result['device']}: {result['wall_s']:.2f} s under the profiler", "",
           "| phase | wall s (profiled) | wall s (iteration before, unprofiled) | device busy s | busy share "
           "| kernels | copies | host only s |", "|---|---|---|---|---|---|---|---|"]
    for r in result["phases"]:
        share = "–" if r["device_busy_share"] is None else f"{100 * r['device_busy_share']:.0f} %"
        before = "–" if r["unprofiled_wall_s"] is None else r["unprofiled_wall_s"]
        out.append(f"| {r['phase']} | {r['wall_s']:.2f} | {before} | {r['device_busy_s']:.2f} | {share} "
                   f"| {r['kernels']} | {r['copies']} | {r['host_only_s']:.2f} |")
    out += ["", "| CPU operator (most self time) | self s | calls |", "|---|---|---|"]
    out += [f"| `{o['name']}` | {o['self_cpu_s']:.3f} | {o['calls']} |" for o in result["top_cpu_ops"]]
    print("\n".join(out), file=report, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    from gsm8kctl.errors import EXIT_BAD_INPUT, UserError

    try:
        main()
    except UserError as exc:  # a bad override, or a config this cannot profile: one line, as gsm8kctl says it
        print(f"profile_iteration.py: {exc}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)

"""`seeds`: one recipe over several seeds, and the numbers to report: medians and ranges.

Each seed is a whole `gsm8kctl loop` in RUN/seed-S/ (its own validation split, warm start, RL
and best checkpoint chosen on validation), then its SFT-only control at equal tokens in
RUN/seed-S/control/ (`gsm8kctl control`). On a GPU the loops run side by side, each within its
share of the GPU's memory (gpu_memory_share = 1/R for R loops at once); on a CPU one after another. Every child's output
goes to RUN/seed-S.log. At the end RUN/seeds.json holds, per seed and as median [min, max]:

    warm_start     test strict of the model the first iteration sampled with
    chosen         test strict of the checkpoint chosen on validation (iteration `chosen_iteration`)
    ratio          chosen / warm_start
    last           test strict at the last evaluation
    control        test strict of the SFT-only control at the chosen checkpoint's tokens
    over_control   chosen - control

and RUN/seeds.png draws each seed's curves. Rerun the same command to resume: a finished loop
or control is not redone, an unfinished one goes on from its run directory.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

from gsm8kctl.artifacts.jsonl import atomic_write_json, read_jsonl
from gsm8kctl.artifacts.paths import OwnFile, check_replaceable
from gsm8kctl.artifacts.rundir import CONTROL_DIR, RUN_METRICS_FILE, SEEDS_PLOT_FILE, SEEDS_SUMMARY_FILE, load_state
from gsm8kctl.errors import StageFailed, UserError
from gsm8kctl.progress import say

METRICS = ("warm_start", "chosen", "ratio", "last", "control", "over_control")


def _is_summary(p: Path) -> bool:
    import json

    data = json.loads(p.read_text(encoding="utf-8"))
    return isinstance(data, dict) and set(data) == {"seeds", "summary"}


SEEDS_SUMMARY = OwnFile(_is_summary, "a seeds summary")  # RUN/seeds.json as `seeds` writes it


def seed_dir(run: Path, seed: int) -> Path:
    return run / f"seed-{seed}"


def seeds(cfg: dict, run_dir: str, *, seed_list: list[int], config: str | None, overrides: list[str],
          parallel: int | None = None, with_control: bool = True, quiet: bool = False) -> dict:
    """Run the loops (and controls) that are not done, then summarise; `cfg` is the recipe, checked."""
    from gsm8kctl.artifacts.paths import check_output_dir

    run = Path(run_dir)
    if len(set(seed_list)) != len(seed_list) or not seed_list:
        raise UserError(f"--seeds: give distinct seeds, got {','.join(map(str, seed_list)) or 'none'}")
    check_output_dir(run, option="--run-dir", files=(SEEDS_SUMMARY_FILE,), data_dir=cfg["data_dir"])
    check_replaceable(run / SEEDS_SUMMARY_FILE, option="--run-dir", kind=SEEDS_SUMMARY)
    gpu = cfg["machine"] == "gpu"
    if parallel is None:
        parallel = len(seed_list) if gpu else 1
    if parallel < 1:
        raise UserError(f"--parallel must be >= 1, got {parallel}")
    at_once = min(parallel, len(seed_list))
    share, given = cfg["gpu_memory_share"], []
    if at_once > 1 and share == "auto":
        # Loops that start together would each size their KV cache from all the memory free when
        # they start: the first takes the most and a later one starves. Each keeps to 1/R instead.
        share = round(1 / at_once, 4)
        given = [f"gpu_memory_share={share}"]
    if gpu and at_once > 1:
        say(memory_plan_line(cfg, at_once, share), quiet)
    run.mkdir(parents=True, exist_ok=True)
    base = [*(["--config", config] if config else []), *overrides, *given]
    loops = {s: ["loop", "--run-dir", str(seed_dir(run, s)), *base, f"seed={s}"] for s in seed_list}
    failed = _run_all(loops, run, parallel, "loop", quiet)  # a finished loop says so and exits at once
    if with_control:
        controls = {s: ["control", str(seed_dir(run, s)), "-o", str(seed_dir(run, s) / CONTROL_DIR), "--quiet"]
                    for s in seed_list if s not in failed}
        failed |= _run_all(controls, run, parallel, "control", quiet)
    summary = summarize(run, seed_list)
    atomic_write_json(run / SEEDS_SUMMARY_FILE, summary)
    plot_seeds(run, seed_list, run / SEEDS_PLOT_FILE)
    if not quiet:
        render_summary(summary)
    if failed:
        logs = ", ".join(str(run / f"seed-{s}.log") for s in sorted(failed))
        raise StageFailed(f"seed(s) {', '.join(map(str, sorted(failed)))} failed (see {logs}); the summary holds "
                          "the others. Rerun the same command to resume")
    return summary


def memory_plan_line(cfg: dict, loops: int, share: float) -> str:
    """The seeds command's start-up line: each loop's share of the GPU and the total, in GiB where
    the driver says how large the GPU is (nvidia-smi; this process opens no CUDA context)."""
    kv = cfg["sampling"]["kv_memory_fraction"]
    line = (f"seeds: {loops} loops at once on the GPU, each within gpu_memory_share={share:g} of its memory "
            f"(torch's allocator capped there, its sampler's KV cache up to {kv:g} of it), "
            f"{loops * share:.2g} of the GPU in total")
    total, used = _gpu_memory_gib()
    if total:
        line += (f": {share * total:.1f} GiB per loop, {loops * share * total:.1f} of {total:.1f} GiB "
                 f"({used:.1f} GiB in use by other programs now)")
    return line


def _gpu_memory_gib() -> tuple[float, float]:
    """(total, used) GiB of GPU 0 from nvidia-smi, or (0, 0) where it does not answer."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits",
                              "--id=0"], capture_output=True, text=True, timeout=10, check=True).stdout
        total, used = (float(x) / 1024 for x in out.strip().split(","))
        return total, used
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0.0, 0.0


def _run_all(commands: dict[int, list[str]], run: Path, parallel: int, what: str, quiet: bool) -> set[int]:
    """Run `gsm8kctl COMMAND` per seed, `parallel` at a time, each logging to RUN/seed-S.log;
    the seeds whose command failed."""
    from gsm8kctl.procs import kill_group, start_supervised

    pending, running, failed = list(commands), {}, set()
    try:
        while pending or running:
            while pending and len(running) < parallel:
                s = pending.pop(0)
                log = open(run / f"seed-{s}.log", "ab")
                log.write(f"=== gsm8kctl {' '.join(commands[s])}\n".encode())
                log.flush()
                proc = start_supervised([sys.executable, "-m", "gsm8kctl", *commands[s]], stdout=log, stderr=log,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
                running[s] = (proc, log, time.time())
                say(f"seed {s}: {what} started (log {run / f'seed-{s}.log'})", quiet)
            for s, (proc, log, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[s]
                minutes = (time.time() - t0) / 60
                if proc.returncode:
                    failed.add(s)
                    say(f"seed {s}: {what} failed (exit {proc.returncode}) after {minutes:.1f} min", quiet)
                else:
                    say(f"seed {s}: {what} done in {minutes:.1f} min", quiet)
            time.sleep(0.5)
    except BaseException:
        for proc, log, _ in running.values():
            kill_group(proc.pid)
            log.close()
        raise
    return failed


# ---------------------------------------------------------------------------------------------
# The numbers


def seed_result(run: Path) -> dict:
    """One seed's numbers (module docstring) from its loop's and control's metrics."""
    path = run / RUN_METRICS_FILE
    rows = {r["iteration"]: r for r in read_jsonl(path)} if path.exists() else {}
    state = load_state(run) if (run / "state.json").exists() else {}
    test = {it: r["test_accuracy_strict"] for it, r in rows.items() if r.get("test_accuracy_strict") is not None}
    out = dict.fromkeys(("warm_start", "chosen", "chosen_iteration", "chosen_on", "ratio", "last",
                         "last_iteration", "control", "over_control"))
    out["done"] = state.get("phase") == "done"
    out["warm_start"] = test.get(0)
    best = state.get("best")
    if best:
        it = max(0, best["iteration"])  # the starting model chosen: report the warm start's numbers
        out.update(chosen_iteration=it, chosen_on=best.get("split", "test"), chosen=test.get(it))
    if test:
        out["last_iteration"] = max(test)
        out["last"] = test[out["last_iteration"]]
    if out["chosen"] is not None and out["warm_start"]:
        out["ratio"] = round(out["chosen"] / out["warm_start"], 3)
    cpath = run / CONTROL_DIR / RUN_METRICS_FILE
    if cpath.exists() and out["chosen_iteration"] is not None:
        match = [r for r in read_jsonl(cpath) if r["iteration"] == out["chosen_iteration"]]
        if match and match[0].get("test_accuracy_strict") is not None:
            out["control"] = match[0]["test_accuracy_strict"]
            if out["chosen"] is not None:
                out["over_control"] = round(out["chosen"] - out["control"], 4)
    return out


def summarize(run: Path, seed_list: list[int]) -> dict:
    per_seed = {str(s): seed_result(seed_dir(run, s)) for s in seed_list}
    agg = {}
    for key in METRICS:
        values = [r[key] for r in per_seed.values() if r[key] is not None]
        agg[key] = ({"median": round(statistics.median(values), 4), "min": min(values), "max": max(values),
                     "n": len(values)} if values else None)
    return {"seeds": per_seed, "summary": agg}


def render_summary(summary: dict) -> None:
    """The per-seed table, then the median and the range over seeds on rows of their own, the units
    in the headers: narrow enough for an 80-column terminal or log without breaking a number."""
    from rich import box
    from rich.table import Table

    from gsm8kctl.progress import console

    pct = lambda v: f"{v * 100:.2f}"  # noqa: E731
    times = lambda v: f"{v:.2f}"  # noqa: E731
    points = lambda v: f"{v * 100:+.2f}"  # noqa: E731
    keys = (("warm_start", pct), ("chosen", pct), ("ratio", times), ("last", pct), ("control", pct),
            ("over_control", points))
    shown = lambda v, fmt: "-" if v is None else fmt(v)  # noqa: E731
    rows = []
    for s, r in summary["seeds"].items():
        cells = [shown(r[k], fmt) for k, fmt in keys]
        if r["chosen"] is not None:
            cells[1] += f" ({r['chosen_iteration']})"
        rows.append([s, *cells])
    agg = summary["summary"]
    median = ["median", *(shown(agg[k] and agg[k]["median"], fmt) for k, fmt in keys)]
    span = ["range", *("-" if agg[k] is None else f"{fmt(agg[k]['min'])}–{fmt(agg[k]['max'])}" for k, fmt in keys)]
    headers = ("seed", "warm start %", "chosen % (iteration)", "ratio ×", "last %", "SFT control %",
               "over control (pt)")
    table = Table(title="seeds: test strict accuracy (the checkpoint chosen on validation)", box=box.SIMPLE_HEAD,
                  padding=(0, 0, 0, 1))
    for i, header in enumerate(headers):
        # As wide as its widest cell or header word: headers wrap between words, numbers never break.
        table.add_column(header, justify="right",
                         width=max(len(w) for w in [*header.split(), *(row[i] for row in [*rows, median, span])]))
    for row in rows:
        table.add_row(*row)
    table.add_section()
    table.add_row(*median)
    table.add_row(*span)
    console.print(table)


def plot_seeds(run: Path, seed_list: list[int], path: Path) -> None:
    """Test (solid) and validation (dotted) strict accuracy of every seed; the control as a cross."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, s in enumerate(seed_list):
        color = f"C{k % 10}"
        mpath = seed_dir(run, s) / RUN_METRICS_FILE
        rows = sorted(read_jsonl(mpath), key=lambda r: r["iteration"]) if mpath.exists() else []
        for key, style, label in (("test_accuracy_strict", "o-", f"seed {s} test"),
                                  ("validation_accuracy_strict", "v:", f"seed {s} validation")):
            pts = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None and r["iteration"] >= 0]
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=label, markersize=3)
        r = seed_result(seed_dir(run, s))
        if r["control"] is not None:
            ax.plot([r["chosen_iteration"]], [r["control"]], "x", color=color, markersize=9,
                    label=f"seed {s} SFT control")
    ax.set_xlabel("iteration (0 = after the warm start)")
    ax.set_ylabel("strict accuracy")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)

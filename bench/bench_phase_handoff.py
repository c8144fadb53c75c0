"""What the in-process loop saves on the host by handing an iteration's tapes and samples from
phase to phase in memory instead of parsing the files again (CPU, no model).

The sample phase writes the tapes and keeps them; the filter phase checks them without reading
the tapes file; the finetune phase counts the filter's samples and the record phase uses them
without reading the samples file. A phase resumed after the one that made them reads the file.

Builds `--tapes` tape-like records as bench_check_records.py does (256 problems of 16 attempts
for 4096), gives about 40 % of the problems one rewarded attempt (so the filter keeps about as
many samples as the loop's iterations do), writes them, then times, alternating, median of
`--repeats`:
- the filter (`run_filter`, no reference model) on the file against the same tapes held;
- the finetune phase's read and check of the samples (`read_samples`) from the file against
  the filter's samples held;
- reading the samples file, which the finetune phase (to count its samples) and the record phase
  each did before;
- the record phase's update of the pass-rate table (RUN/pass_rates.jsonl) after `--history`
  iterations of as many problems, read from the file against held in memory (the sample phase's
  choice of problems read the same file once more before).
Prints a table and writes JSON.

    python bench/bench_phase_handoff.py --tapes 4096 --out phase-handoff.json
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
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--history", type=int, default=47, help="iterations already in the pass-rate table")
    ap.add_argument("--out", default="phase-handoff.json")
    a = ap.parse_args()

    from bench_check_records import records

    from gsm8kctl.artifacts.jsonl import read_jsonl, write_jsonl
    from gsm8kctl.artifacts.samples import read_samples
    from gsm8kctl.config import load_config
    from gsm8kctl.loop.curriculum import read_pass_rates, record_pass_rates
    from gsm8kctl.stages.filter import run_filter

    tapes, _ = records(a.tapes)
    rng = random.Random(1)
    for start in range(0, len(tapes), 16):
        if rng.random() < 0.4:
            tapes[start]["reward"], tapes[start]["correct"] = 1.0, True
    cfg = load_config(None, ["filter.ref_model=null"])
    times: dict[str, list[float]] = {"filter, tapes read from the file": [], "filter, tapes held": [],
                                     "finetune's samples, read from the file": [],
                                     "finetune's samples, held": [], "reading the samples file": [],
                                     "pass-rate table, read from the file": [], "pass-rate table, held": []}
    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "tapes.jsonl", Path(tmp) / "samples.jsonl"
        write_jsonl(path, tapes)
        run_filter([str(path)], str(out), cfg, quiet=True)  # imports (torch) paid before timing
        # The table after --history iterations of 256 problems each, drawn in order from the
        # 6973 training problems (so most have one or two iterations of history).
        rates = Path(tmp) / "pass_rates.jsonl"
        problems = len({t["problem_id"] for t in tapes})
        for it in range(a.history):
            past = [{"problem_id": f"train-{(it * problems + j // 16) % 6973:05d}", "correct": rng.random() < 0.06}
                    for j in range(len(tapes))]
            record_pass_rates(rates, it, past)
        table = read_pass_rates(rates)
        kept = 0
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            run_filter([str(path)], str(out), cfg, quiet=True, tapes_read=[])
            times["filter, tapes read from the file"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            written: list[dict] = []
            run_filter([str(path)], str(out), cfg, quiet=True, tapes_given=tapes, samples_written=written)
            times["filter, tapes held"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            read_samples([out], seq_length=2048, vocab_size=49152)
            times["finetune's samples, read from the file"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            read_samples([out], seq_length=2048, vocab_size=49152, given=written)
            times["finetune's samples, held"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            kept = len(list(read_jsonl(out)))
            times["reading the samples file"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            read_pass_rates(rates)
            record_pass_rates(rates, a.history, tapes)
            times["pass-rate table, read from the file"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            table = record_pass_rates(rates, a.history, tapes, table)
            times["pass-rate table, held"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    saved = (med["filter, tapes read from the file"] - med["filter, tapes held"]
             + med["finetune's samples, read from the file"] - med["finetune's samples, held"]
             + 2 * med["reading the samples file"]
             + med["pass-rate table, read from the file"] - med["pass-rate table, held"])
    print(f"{a.tapes} tapes, {kept} samples kept; seconds, median of {a.repeats} (alternating)")
    print("| what | s |")
    print("|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} |")
    print(f"| saved per iteration (the three differences + the samples file read twice) | {saved:.3f} |")
    with open(a.out, "w") as f:
        json.dump({"tapes": a.tapes, "samples": kept, "repeats": a.repeats, "history": a.history, "median_s": med,
                   "runs_s": times, "saved_per_iteration_s": saved}, f, indent=1)


if __name__ == "__main__":
    main()

"""What checking each tape and each training sample costs (CPU): the filter phase checks every tape
of an iteration, finetune every sample, before any of them is used; and what reading an
iteration's tapes file costs.

Builds `--tapes` tape-like records (150 prompt token ids, 40 to 300 completion token ids with their
log-probs, as the loop's sampler writes them) and as many samples (ids, old and reference
log-probs), then times `check_tape(tokens=True)` and `check_sample` per record, median of
`--repeats`. With `--against REV` it times gsm8kctl/artifacts/tapes.py and samples.py at REV beside
this tree's, alternating, in one process. Then it writes the tapes to a file and times reading
them back with `read_jsonl`. Prints a table and writes JSON.

    python bench/bench_check_records.py --tapes 4096 --against 65f2ec5 --out check-records.json
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


def records(n: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(0)
    tapes, samples = [], []
    for i in range(n):
        prompt = [rng.randrange(49152) for _ in range(150)]
        completion = [rng.randrange(49152) for _ in range(rng.randint(40, 300))]
        logprobs = [round(-rng.expovariate(3.0), 6) for _ in completion]
        tapes.append({"id": f"train-{i // 16:05d}-i0003-a{i % 16:02d}-abcdef", "iteration": 3,
                      "problem_id": f"train-{i // 16:05d}", "attempt": i % 16, "reward": 0.0,
                      "correct": False, "finish_reason": "stop", "answer": {"format": True},
                      "question": "Janet's ducks lay 16 eggs per day. " * 7,
                      "steps": [{"kind": "reasoning", "text": "She eats 3 for breakfast. " * (len(completion) // 6)}],
                      "prompt_token_ids": prompt, "completion_token_ids": completion,
                      "logprobs": logprobs})
        samples.append({"id": tapes[-1]["id"], "input_ids": prompt + completion, "prompt_len": len(prompt),
                        "old_logprobs": logprobs, "ref_logprobs": [x - 0.01 for x in logprobs],
                        "reward": 0.0, "weight": -0.25, "advantage": -0.25, "kl": 0.01})
    return tapes, samples


def time_per_record(fn, items: list[dict], repeats: int) -> list[float]:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k, item in enumerate(items):
            fn(item, f"bench.jsonl:{k + 1}")
        runs.append((time.perf_counter() - t0) / len(items) * 1e6)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tapes", type=int, default=4096, help="tapes, and as many samples")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="check-records.json")
    ap.add_argument("--against", help="a git revision whose tapes.py and samples.py to time beside this tree's")
    a = ap.parse_args()

    import gsm8kctl.artifacts.samples as samples_now
    import gsm8kctl.artifacts.tapes as tapes_now

    versions = {"this tree": (tapes_now, samples_now)}
    if a.against:
        from module_at import module_at

        tapes_then = module_at(a.against, "gsm8kctl/artifacts/tapes.py")
        samples_then = module_at(a.against, "gsm8kctl/artifacts/samples.py")
        # samples.py took its list checks from tapes.py by import: give it the revision's own.
        for name in ("is_int_list", "is_number", "is_number_list"):
            if hasattr(tapes_then, name):
                setattr(samples_then, name, getattr(tapes_then, name))
                setattr(samples_then, f"_{name}", getattr(tapes_then, name))
        versions[a.against] = (tapes_then, samples_then)
    tapes, samples = records(a.tapes)
    runs: dict[str, dict[str, list[float]]] = {v: {"check_tape": [], "check_sample": []} for v in versions}
    for _ in range(a.repeats):  # alternating, so drift in the machine's speed hits both alike
        for name, (tmod, smod) in versions.items():
            runs[name]["check_tape"] += time_per_record(lambda t, w: tmod.check_tape(t, w, tokens=True), tapes, 1)
            runs[name]["check_sample"] += time_per_record(smod.check_sample, samples, 1)
    result = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in runs.items()}
    # What the in-process loop no longer does: read an iteration's tapes file back (its phases
    # hand the tapes on in memory; bench_phase_handoff.py times the whole handoff).
    from gsm8kctl.artifacts.jsonl import read_jsonl, write_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tapes.jsonl"
        write_jsonl(path, tapes)
        reads = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            list(read_jsonl(path))
            reads.append(time.perf_counter() - t0)
    read_s = statistics.median(reads)
    print(f"{a.tapes} tapes and {a.tapes} samples, µs per record, median of {a.repeats}")
    print("| code | check_tape | check_sample | both, s per iteration of this many |")
    print("|---|---|---|---|")
    for name, r in result.items():
        total = (r["check_tape"] + r["check_sample"]) * a.tapes / 1e6
        print(f"| {name} | {r['check_tape']:.1f} | {r['check_sample']:.1f} | {total:.3f} |")
    print(f"reading the {a.tapes} tapes back from their file: {read_s:.3f} s")
    with open(a.out, "w") as f:
        json.dump({"tapes": a.tapes, "repeats": a.repeats, "us_per_record": result, "read_tapes_file_s": read_s},
                  f, indent=1)


if __name__ == "__main__":
    main()

"""The GIL convoy that `gsm8kctl/sampling/hostgate.py` removes, without a GPU: a "sampling" thread runs
windows of short torch calls followed by a blocking wait (a sleep standing in for the device),
beside a "writer" thread that encodes tape-sized JSON. Three ways side by side, alternating,
medians: no writer; writer free-running; writer behind the gate.

    python bench/bench_host_gate.py --json host-gate.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gsm8kctl.sampling.hostgate import HostGate  # noqa: E402

TAPE = {"completion_token_ids": list(range(350)), "logprobs": [-0.123456] * 350, "text": "x" * 1200}


def run(mode: str, windows: int, ops: int, wait_s: float) -> dict:
    x = torch.zeros(64)
    gate = HostGate() if mode == "gated" else None
    stop = threading.Event()
    units = [0]

    def writer() -> None:
        while not stop.is_set():
            if gate is not None:
                gate.wait()
            json.dumps(TAPE)
            units[0] += 1

    thread = threading.Thread(target=writer) if mode != "alone" else None
    if thread:
        thread.start()
    t0 = time.perf_counter()
    with gate.held() if gate else nullcontext():
        for _ in range(windows):
            for _ in range(ops):
                x.add_(1.0)  # a short call that releases the GIL, as a CUDA launch does
            with gate.released() if gate else nullcontext():
                time.sleep(wait_s)  # the device computing; the GIL is free
    wall = time.perf_counter() - t0
    stop.set()
    if thread:
        thread.join()
    return {"wall_s": wall, "writer_units": units[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=100)
    ap.add_argument("--ops", type=int, default=24, help="short torch calls per window (8 replays + 16 copies)")
    ap.add_argument("--wait-ms", type=float, default=20.0, help="the device's time per window")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    modes = ("alone", "free writer", "gated")
    got: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(a.repeats):
        for m in modes:
            got[m].append(run(m, a.windows, a.ops, a.wait_ms / 1000))
    floor = a.windows * a.wait_ms / 1000
    rows = []
    print(f"{a.windows} windows of {a.ops} torch calls + a {a.wait_ms:g} ms wait (floor {floor:.2f} s); "
          f"median of {a.repeats}")
    print(f"{'writer':12} {'wall s':>8} {'host s per window (ms)':>24} {'writer units':>13}")
    for m in modes:
        wall = statistics.median(r["wall_s"] for r in got[m])
        units = statistics.median(r["writer_units"] for r in got[m])
        rows.append({"writer": m, "wall_s": round(wall, 3), "host_ms_per_window": round((wall - floor) / a.windows * 1e3, 2),
                     "writer_units": units})
        print(f"{m:12} {wall:8.3f} {rows[-1]['host_ms_per_window']:24.2f} {units:13.0f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

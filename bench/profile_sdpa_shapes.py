"""What SDPA's first call of a new shape costs on one GPU, by backend set (one set per process).

A `sample` process's admissions took ~3x the host time of the same admissions repeated in one
process (one H200, 2026-12-03; docs/benchmarks.md), and in the first pass SDPA alone was 3.3 of
7.1 s. Prefill and
score shapes change with every batch; if SDPA sends them to cuDNN, cuDNN builds an execution
plan per new shape. This runs the prefill's attention (causal, right-padded, the SmolLM2-135M
heads) over `--shapes` new (rows, width) shapes, each called twice with a sync around each call,
and prints the backend torch picks and the first and second call's time.

    python bench/profile_sdpa_shapes.py --backends default --out sdpa-default.json
    python bench/profile_sdpa_shapes.py --backends no-cudnn --out sdpa-no-cudnn.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", choices=["default", "no-cudnn", "cudnn"], default="default")
    ap.add_argument("--shapes", type=int, default=40)
    ap.add_argument("--budget", type=int, default=8192, help="padded tokens per call, as the prefill budget")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--out", default="sdpa.json")
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sets = {"default": None,
            "no-cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
            "cudnn": [SDPBackend.CUDNN_ATTENTION]}
    chosen = sets[a.backends]
    names = {int(b.value): n for n, b in SDPBackend.__members__.items()}
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    rows_out = []
    for i in range(a.shapes):
        width = 96 + 4 * i  # GSM8k prompt widths
        rows = max(1, a.budget // width)
        q, k, v = (torch.randn(rows, a.heads, width, a.head_dim, device=dev, dtype=torch.bfloat16) for _ in range(3))
        pick = torch._fused_sdp_choice(q, k, v, None, 0.0, True)
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with sdpa_kernel(chosen) if chosen else nullcontext():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rows_out.append({"rows": rows, "width": width, "default_choice": names[int(pick)],
                         "first_ms": times[0] * 1e3, "second_ms": times[1] * 1e3})
    first = [r["first_ms"] for r in rows_out[1:]]  # the very first call also pays CUDA's lazy init
    second = [r["second_ms"] for r in rows_out]
    summary = {"backends": a.backends, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
               "default_choices": sorted({r["default_choice"] for r in rows_out}),
               "first_call_ms_median": statistics.median(first), "first_calls_total_s": sum(first) / 1e3,
               "second_call_ms_median": statistics.median(second)}
    print(f"| backends | torch's own pick | first call, median ms | second call, median ms | first calls, total s |")
    print("|---|---|---|---|---|")
    print(f"| {a.backends} | {', '.join(summary['default_choices'])} | {summary['first_call_ms_median']:.2f} | "
          f"{summary['second_call_ms_median']:.3f} | {summary['first_calls_total_s']:.2f} |")
    with open(a.out, "w") as f:
        json.dump({"summary": summary, "shapes": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()

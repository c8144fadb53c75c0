"""Sampling and evaluation throughput of the transformers backend on one GPU, through the CLI.

Runs the real commands (`gsm8kctl evaluate`, `gsm8kctl sample`) on a model directory, static KV
cache (compiled decode step) against the dynamic cache, and prints a table + writes JSON.

    python scripts/bench_gpu_sampling.py --model DIR --data-dir DATA --out bench.json
    python scripts/bench_gpu_sampling.py --gguf SmolLM2.gguf ...   # convert the embedded GGUF first
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(args: list[str], env_data: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "gsm8kctl", *args], capture_output=True, text=True,
                          env={**os.environ, "GSM8K_DIR": env_data})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return wall, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--gguf")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", default="bench_gpu_sampling.json")
    ap.add_argument("--eval-limit", type=int, default=None, help="default: the full test split")
    ap.add_argument("--sample-problems", type=int, default=128)
    ap.add_argument("--attempts", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--dynamic-limit", type=int, default=256)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    model = a.model
    if a.gguf:
        from gsm8kctl.models import convert_gguf

        t0 = time.perf_counter()
        model = str(work / "model")
        convert_gguf(Path(a.gguf), Path(model))
        print(f"converted {a.gguf} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    rows = []
    common = ["--model", model, "--backend", "transformers", "-q"]
    bs = [f"sampling.batch_size={a.batch_size}"]

    limit = ["--limit", str(a.eval_limit)] if a.eval_limit else []
    wall, out = run(["evaluate", *common, "-o", str(work / "eval_static"), "--json", *limit, *bs], a.data_dir)
    m = json.loads(out)
    rows.append({"run": "evaluate greedy, static cache", "n": m["n"], "wall_s": round(wall, 1),
                 "tokens_per_s": m["tokens_per_s"], "accuracy_strict": m["accuracy_strict"],
                 "accuracy_lenient": m["accuracy_lenient"], "format_rate": m["format_rate"],
                 "mean_output_tokens": m["mean_output_tokens"]})

    wall, out = run(["evaluate", *common, "-o", str(work / "eval_dynamic"), "--json", "--limit",
                     str(a.dynamic_limit), "transformers.static_cache=false", *bs], a.data_dir)
    m = json.loads(out)
    rows.append({"run": "evaluate greedy, dynamic cache", "n": m["n"], "wall_s": round(wall, 1),
                 "tokens_per_s": m["tokens_per_s"], "accuracy_strict": m["accuracy_strict"],
                 "accuracy_lenient": m["accuracy_lenient"], "format_rate": m["format_rate"],
                 "mean_output_tokens": m["mean_output_tokens"]})

    tapes = work / "sample" / "tapes.jsonl"
    wall, _ = run(["sample", *common, "-o", str(tapes), "--n-problems", str(a.sample_problems), "--attempts",
                   str(a.attempts), "--temperature", "1.0", "--max-tokens", "512", *bs], a.data_dir)
    _, out = run(["stats", "--json", str(tapes)], a.data_dir)
    s = json.loads(out)
    gen_tokens = s["tokens"]["completion"]["mean"] * s["count"]
    rows.append({"run": f"sample T=1 x{a.attempts}, static cache", "n": s["count"], "wall_s": round(wall, 1),
                 "tokens_per_s": round(gen_tokens / wall, 1), "accuracy_strict": s["accuracy_strict"],
                 "accuracy_lenient": s["accuracy_lenient"], "format_rate": s["format_rate"],
                 "mean_output_tokens": s["tokens"]["completion"]["mean"]})

    import torch

    result = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "model": a.gguf or model, "batch_size": a.batch_size, "rows": rows}
    Path(a.out).write_text(json.dumps(result, indent=2))
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))


if __name__ == "__main__":
    main()

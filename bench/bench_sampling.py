"""Sampling and scoring speed of each backend on the same GSM8k prompts and settings.

    python bench/bench_sampling.py --out bench.json            # every available backend
    python bench/bench_sampling.py --backends vllm,openai --n-prompts 8
    python bench/bench_sampling.py --backends vllm vllm.dtype=float32   # config overrides, key=value

Each backend runs in its own subprocess (so start-up includes its imports, and memory is not
shared between backends): start-up s (imports + engine/model load; for `openai` also starting a
local `vllm serve` and waiting for /health), generated tokens/s (completion tokens of one
`generate` call over its wall time, after a 4-token warm-up call), scoring tokens/s (prompt +
completion tokens through `score()` per second), peak RSS (sum over the process tree, sampled
every 0.2 s; shared pages are counted once per process). Trailing `key=value` arguments override
the default config, as on the gsm8kctl command line. The table goes to stdout, JSON to --out; the
machine's CPU model and its bf16 instructions go into the JSON (bf16 is emulated without them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchutil import PeakRSS  # bench/ is on sys.path when a script in it runs

BACKENDS = ("transformers", "vllm", "openai")


def _prompts(tokenizer, n_prompts: int, data_dir: str | None) -> list[list[int]]:
    from gsm8kctl import agent
    from gsm8kctl.artifacts.chat import render_prompt
    from gsm8kctl.artifacts.data import load_problems

    problems = load_problems("test", data_dir)[:n_prompts]
    return [render_prompt(tokenizer, agent.build_messages(p["question"]))[1] for p in problems]


def run_one(args) -> dict:
    """Measure one backend in this process."""
    from gsm8kctl.artifacts.models import resolve_model
    from gsm8kctl.config import load_config
    from gsm8kctl.sampling.backends import SamplingParams, get_backend

    cfg = load_config(None, args.overrides)
    cfg["sampling"]["batch_size"] = args.n_prompts * args.n  # transformers: one batch, like the notes
    model = resolve_model(args.model)
    server = None
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        if args.worker == "openai":
            from gsm8kctl.loop.serve import VLLMServer

            server = VLLMServer(model, cfg=cfg, log_path=Path(tempfile.gettempdir()) / "bench-vllm-server.log")
            server.__enter__()
            backend = get_backend("openai", model, cfg=cfg, base_url=server.base_url, concurrency=args.n_prompts)
        else:
            backend = get_backend(args.worker, model, cfg=cfg)
        startup = time.perf_counter() - t0
        try:
            prompts = _prompts(backend.tokenizer, args.n_prompts, args.data_dir)
            backend.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_tokens=4))  # warm-up
            params = SamplingParams(n=args.n, temperature=args.temperature, top_p=1.0,
                                    max_tokens=args.max_tokens, seed=args.seed)
            load_before = os.getloadavg()[0]
            c1, t1 = rss.cpu_seconds(), time.perf_counter()
            out = backend.generate(prompts, params)
            gen_s = time.perf_counter() - t1
            gen_cores = (rss.cpu_seconds() - c1) / gen_s
            comps = [c for cs in out for c in cs]
            gen_tokens = sum(len(c.token_ids) for c in comps)
            ps = [p for p, cs in zip(prompts, out) for _ in cs]
            cs = [c.token_ids for c in comps]
            t2 = time.perf_counter()
            backend.score(ps, cs)
            score_s = time.perf_counter() - t2
            score_tokens = sum(len(p) + len(c) for p, c in zip(ps, cs))
        finally:
            backend.close()
            if server is not None:
                server.__exit__(None, None, None)
    return {
        "backend": args.worker,
        "startup_s": round(startup, 1),
        "generated_tokens": gen_tokens,
        "generate_s": round(gen_s, 1),
        "generated_tok_s": round(gen_tokens / gen_s, 1),
        "stop_rate": round(sum(c.finish_reason == "stop" for c in comps) / len(comps), 3),
        "scored_tokens": score_tokens,
        "score_s": round(score_s, 1),
        "scoring_tok_s": round(score_tokens / score_s, 1),
        "peak_rss_gib": round(rss.peak / 2**30, 2),
        # Other work on the machine slows every backend: the 1-min load average before
        # generating, and the cores our process tree actually used while generating.
        "load_avg_1m": round(load_before, 2),
        "cores_used_generating": round(gen_cores, 2),
    }


def _cpu() -> dict:
    """The CPU model and whether it has bf16 instructions (Linux /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), None)
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return {"cpu_model": model, "cpu_bf16": sorted(flags & {"avx512_bf16", "amx_bf16"})}


def _available(name: str) -> bool:
    import importlib.util

    return name == "transformers" or importlib.util.find_spec("vllm") is not None


def _table(results: list[dict]) -> str:
    cols = [("backend", "backend"), ("start-up s", "startup_s"), ("generated tok/s", "generated_tok_s"),
            ("scoring tok/s", "scoring_tok_s"), ("peak RSS GiB", "peak_rss_gib"),
            ("gen tokens", "generated_tokens"), ("stop rate", "stop_rate"), ("load avg", "load_avg_1m"),
            ("cores used", "cores_used_generating")]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join(str(r.get(k, r.get("error", ""))) for _, k in cols) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=None, help="GSM8k directory (default: $GSM8K_DIR or the hub)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args, args.overrides = ap.parse_known_args()
    if any("=" not in o for o in args.overrides):
        ap.error(f"unrecognized arguments: {' '.join(o for o in args.overrides if '=' not in o)}")

    if args.worker:
        Path(args.result).write_text(json.dumps(run_one(args)))
        return 0

    results = []
    for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
        if name not in BACKENDS:
            ap.error(f"unknown backend {name}")
        if not _available(name):
            print(f"skip {name}: vllm is not installed", file=sys.stderr)
            continue
        print(f"benchmarking {name} ...", file=sys.stderr, flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            result_path = f.name
        cmd = [sys.executable, __file__, "--worker", name, "--result", result_path]
        for key in ("model", "n_prompts", "n", "temperature", "max_tokens", "seed", "data_dir"):
            value = getattr(args, key)
            if value is not None:
                cmd += [f"--{key.replace('_', '-')}", str(value)]
        cmd += args.overrides
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        text = Path(result_path).read_text() if os.path.getsize(result_path) else ""
        os.unlink(result_path)
        if text:
            # vLLM sometimes aborts at exit after complete results (see the notes); keep them.
            results.append({**json.loads(text), "exit_code": proc.returncode})
        else:
            tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
            results.append({"backend": name, "error": f"exit {proc.returncode}: {tail[0][:200]}"})
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)

    report = {
        "settings": {"model": args.model, "prompts": args.n_prompts, "n": args.n, "temperature": args.temperature,
                     "max_tokens": args.max_tokens, "seed": args.seed, "source": "GSM8k test, zero-shot agent prompt",
                     "overrides": args.overrides},
        "machine": {"cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                    "platform": platform.platform(), "python": platform.python_version(), **_cpu()},
        "results": results,
    }
    print(_table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

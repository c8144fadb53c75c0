"""What sharing one prefill among a problem's attempts saves when sampling (CPU or CUDA).

Both decode paths of the transformers backend (the slot engine, CUDA's default, and the dynamic
cache, the CPU's), side by side in one process, alternating, medians of `--repeats`: PROMPTS x ATTEMPTS
attempts as the loop samples them (each prompt repeated, so its rows share one prefill), against
the same number of rows whose prompts all differ in their last token (same lengths, nothing to
share). Both decode `--max-tokens` tokens per row, so the difference is the prefill. Then
`score()` on the same two prompt sets with completions of 40-200 tokens (the reference model's
pass in `filter`), where shared prompts run once per prompt.

    python bench/bench_prefix_prefill.py --model smollm2-135m --out prefix.json     # this CPU
    python bench/bench_prefix_prefill.py --model "$SMOLLM2" --prompts 256 --attempts 16 --out prefix.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from bench_gpu_sampling import gsm8k_like_prompts  # bench/ is on sys.path when run as a script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="model name or HF directory")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--attempts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    a = ap.parse_args()

    import torch

    from gsm8kctl.artifacts.models import resolve_model
    from gsm8kctl.config import load_config
    from gsm8kctl.sampling.backends.base import SamplingParams
    from gsm8kctl.sampling.backends.transformers import TransformersBackend

    rows_n = a.prompts * a.attempts
    base = gsm8k_like_prompts(a.prompts)
    distinct = [p[:-1] + [p[-1] + j + 1] for p in base for j in range(a.attempts)]
    runs = {"shared prefill (attempts of one prompt)": (base, a.attempts),  # n repeats each prompt
            "distinct prompts, same lengths": (distinct, 1)}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    table = []
    for path, static in (("slot engine", "true"), ("dynamic cache", "false")):
        cfg = load_config(None, [f"transformers.static_cache={static}", f"sampling.max_slots={rows_n}",
                                 f"sampling.batch_size={rows_n}"])
        backend = TransformersBackend(resolve_model(a.model), cfg)

        def once(prompts, n):
            params = SamplingParams(n=n, temperature=1.0, max_tokens=a.max_tokens, seed=1)
            sync()
            t0 = time.perf_counter()
            backend.generate(prompts, params)
            sync()
            return time.perf_counter() - t0

        once(base, a.attempts)  # warm-up: engine, graphs, allocator
        walls: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(a.repeats):
            for name, (prompts, n) in runs.items():
                walls[name].append(once(prompts, n))
        for name in runs:
            table.append({"path": path, "run": name, "rows": rows_n,
                          "median_s": round(statistics.median(walls[name]), 3),
                          "walls_s": [round(w, 3) for w in walls[name]]})
        table[-1]["distinct_over_shared"] = round(table[-1]["median_s"] / table[-2]["median_s"], 2)
        device = backend.device
        if static == "false":  # score() has one path: measured once, the same way
            rng = random.Random(2)
            completions = [[rng.randrange(100, 40000) for _ in range(rng.randrange(40, 200))]
                           for _ in range(rows_n)]
            shared_p = [p for p in base for _ in range(a.attempts)]
            score_walls: dict[str, list[float]] = {"score, shared prompts": [], "score, distinct prompts": []}
            for _ in range(a.repeats):
                for name, ps in zip(score_walls, (shared_p, distinct)):
                    sync()
                    t0 = time.perf_counter()
                    backend.score(ps, completions)
                    sync()
                    score_walls[name].append(time.perf_counter() - t0)
            for name, w in score_walls.items():
                table.append({"path": "score()", "run": name, "rows": rows_n,
                              "median_s": round(statistics.median(w), 3), "walls_s": [round(x, 3) for x in w]})
            table[-1]["distinct_over_shared"] = round(table[-1]["median_s"] / table[-2]["median_s"], 2)
        backend.close()
    print(f"device {device}, {a.prompts} prompts x {a.attempts} attempts, {a.max_tokens} new tokens each")
    print("| path | run | rows | median s | runs s | distinct / shared |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['path']} | {r['run']} | {r['rows']} | {r['median_s']} | "
              f"{', '.join(map(str, r['walls_s']))} | {r.get('distinct_over_shared', '')} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": str(device), "args": vars(a), "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()

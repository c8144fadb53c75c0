"""Our transformers decode loop against plain `model.generate` at equal batch (same prompts, T=1).

    python bench/bench_decode_vs_generate.py --model smollm2-135m --prompts 32 --n 4 --max-tokens 256 --out b.json

Both paths sample all rows in one batch of prompts x n; generated tokens count up to and including
the stop token. The loop also returns each token's log-prob; `generate` is run without scores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench_decode_vs_generate.json")
    a = ap.parse_args()

    import torch

    from gsm8kctl.agent import build_messages
    from gsm8kctl.artifacts.chat import render_prompt
    from gsm8kctl.artifacts.data import load_problems
    from gsm8kctl.artifacts.models import resolve_model
    from gsm8kctl.sampling.backends.base import SamplingParams
    from gsm8kctl.sampling.backends.transformers import TransformersBackend

    path = resolve_model(a.model)
    rows = a.prompts * a.n
    from gsm8kctl.config import load_config

    backend = TransformersBackend(path, load_config(None, [f"sampling.batch_size={rows}"]))
    tok, model = backend.tokenizer, backend.model_obj
    problems = load_problems("test", os.environ.get("GSM8K_DIR"))[:a.prompts]
    prompts = [render_prompt(tok, build_messages(p["question"]))[1] for p in problems]

    def ours(seed: int) -> int:
        out = backend.generate(prompts, SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=seed))
        return sum(len(c.token_ids) for o in out for c in o)

    def plain(seed: int) -> int:
        torch.manual_seed(seed)
        width = max(len(p) for p in prompts)
        ids = torch.full((rows, width), backend.pad_id)
        attn = torch.zeros_like(ids)
        for r in range(rows):
            p = prompts[r // a.n]
            ids[r, width - len(p):] = torch.tensor(p)
            attn[r, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, max_new_tokens=a.max_tokens, eos_token_id=backend.stop_ids,
                                 pad_token_id=backend.pad_id)
        gen = out[:, width:].tolist()
        stop = set(backend.stop_ids)
        return sum(next((i + 1 for i, t in enumerate(g) if t in stop), len(g)) for g in gen)

    results = {}
    for name, fn in (("gsm8kctl decode loop (+ logprobs)", ours), ("model.generate", plain)):
        rates = []
        for rep in range(a.repeats):
            t0 = time.perf_counter()
            n_tok = fn(rep)
            rates.append(n_tok / (time.perf_counter() - t0))
        results[name] = {"tokens_per_s": [round(r, 1) for r in rates], "median": round(statistics.median(rates), 1)}
    info = {"model": a.model, "rows": rows, "max_tokens": a.max_tokens, "threads": torch.get_num_threads(),
            "results": results}
    Path(a.out).write_text(json.dumps(info, indent=2))
    print("| path | batch | tok/s (median) | runs |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {rows} | {r['median']} | {r['tokens_per_s']} |")


if __name__ == "__main__":
    main()

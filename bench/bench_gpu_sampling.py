"""Sampling throughput of the transformers backend on one GPU: the slot engine (continuous
batching, CUDA-graphed decode) against `model.generate(cache_implementation="static")`.

Parts (`--parts`, comma-separated), each a row or more of one table, all in one JSON file:
  shapes    random-init shapes (SmolLM2-135M, Qwen2.5-1.5B dims) in-process: generate + score
  score     random-init SmolLM2-135M in-process: one generate (the sampling throughput) against
            score() over GSM8k-like completion lengths at several token budgets and logit chunks,
            both paths side by side: one pass per row, and shared prompts (8 rows per prompt)
  parity    float32 greedy: slot engine vs the dynamic-cache path on the same GPU, token ids saved
  cli       the real commands on the real model: `sample` 1024 problems x 8 (twice: a first and a
            second process), `evaluate` on the whole test split; wall time includes start + load
  generate  `model.generate(cache_implementation="static")` on the same 8192 prompts, batch 1024

    python bench/bench_gpu_sampling.py --parts shapes --tokenizer DIR --out bench.json
    python bench/bench_gpu_sampling.py --parts parity,cli,generate --gguf SmolLM2.gguf --data-dir DATA
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {  # name -> (config class, kwargs)
    "135m": ("LlamaConfig", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                 max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)),
    "1.5b": ("Qwen2Config", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                 max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True)),
}


def random_model(shape: str, tokenizer: str, out: Path) -> str:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cls, kw = SHAPES[shape]
    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = getattr(transformers, cls)(**kw, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                        bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return str(out)


def gsm8k_like_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of GSM8k's length spread (chat template + question: 90-260 tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(90, 260))] for _ in range(n)]


def cfg_with(*overrides: str) -> dict:
    from gsm8kctl.config import load_config

    return load_config(None, list(overrides))


def timed_generate(backend, prompts, params):
    """One generate call timed between GPU syncs: (outputs, wall seconds, generated tokens)."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = backend.generate(prompts, params)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0, sum(len(c.token_ids) for o in out for c in o)


def part_shapes(a, work: Path, rows: list) -> None:
    import torch

    from gsm8kctl.sampling.backends.base import SamplingParams
    from gsm8kctl.sampling.backends.transformers import TransformersBackend

    for shape, attempts in (("135m", a.shape_attempts_135m), ("1.5b", a.shape_attempts_15b)):
        path = random_model(shape, a.tokenizer, work / f"rand-{shape}")
        backend = TransformersBackend(path, cfg_with(*a.overrides), dtype="bfloat16")
        prompts = gsm8k_like_prompts(attempts // 8)
        params = SamplingParams(n=8, temperature=1.0, max_tokens=a.max_tokens, seed=1)
        for run in ("first call", "second call"):
            out, wall, n_tok = timed_generate(backend, prompts, params)
            st = dict(backend._engine.stats)
            rows.append({"part": "shapes", "run": f"{shape} generate x{attempts}, {run}", "n": attempts,
                         "wall_s": round(wall, 2), "tokens": n_tok, "tokens_per_s": round(n_tok / wall),
                         "slots": backend._engine.slots, "max_len": backend._engine.max_len,
                         "attention": backend._engine.attention,
                         "capture_s": round(st["capture_s"], 2), "graphs": st["graph_captures"],
                         "occupancy": round(st["slot_steps_busy"] / max(1, st["slot_steps_run"]), 3)})
            print(rows[-1], file=sys.stderr, flush=True)
        flat_p = [p for p in prompts for _ in range(8)]
        flat_c = [c.token_ids for o in out for c in o]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        backend.score(flat_p, flat_c)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        scored = sum(len(c) for c in flat_c)
        rows.append({"part": "shapes", "run": f"{shape} score x{attempts}", "n": attempts, "wall_s": round(wall, 2),
                     "tokens": scored, "tokens_per_s": round(scored / wall),
                     "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1)})
        print(rows[-1], file=sys.stderr, flush=True)
        backend.close()
        del backend
        torch.cuda.empty_cache()


def completion_lengths(n: int, seed: int = 1) -> list[int]:
    """Completion lengths as the filter sees them from the real model: most 60-200 tokens, a tail to 512."""
    rng = random.Random(seed)
    return [min(512, max(8, int(rng.lognormvariate(4.8, 0.5)))) for _ in range(n)]


def part_score(a, work: Path, rows: list) -> None:
    import statistics

    import torch

    from gsm8kctl.sampling.backends.base import SamplingParams
    from gsm8kctl.sampling.backends.transformers import TransformersBackend, distinct_prompts
    from gsm8kctl.training.trainer import logprobs

    attempts = a.shape_attempts_135m
    path = random_model("135m", a.tokenizer, work / "rand-135m")
    backend = TransformersBackend(path, cfg_with(*a.overrides), dtype="bfloat16")
    prompts = gsm8k_like_prompts(attempts // 8)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=a.max_tokens, seed=1)
    out, wall, n_tok = timed_generate(backend, prompts, params)
    rows.append({"part": "score", "run": f"135m generate x{attempts} (first call)", "n": attempts,
                 "wall_s": round(wall, 2), "tokens": n_tok, "tokens_per_s": round(n_tok / wall),
                 "slots": backend._engine.slots})
    print(rows[-1], file=sys.stderr, flush=True)
    rng = random.Random(2)
    flat_p = [p for p in prompts for _ in range(8)]
    flat_c = [[rng.randrange(100, 40000) for _ in range(n)] for n in completion_lengths(attempts)]
    scored = sum(map(len, flat_c))
    chunk_default = logprobs.token_logprobs.__kwdefaults__["chunk_tokens"]
    unique, which = distinct_prompts(flat_p)
    paths = {"one pass per row": lambda: backend._score_rows(flat_p, flat_c),
             "shared prompts": lambda: backend._score_shared(unique, which, flat_c)}
    for budget, chunk, path in ((16384, chunk_default, "one pass per row"), (16384, chunk_default, "shared prompts"),
                                (65536, chunk_default, "one pass per row"), (65536, chunk_default, "shared prompts"),
                                (262144, chunk_default, "one pass per row"), (262144, chunk_default, "shared prompts"),
                                (262144, 8192, "one pass per row")):
        if path == "shared prompts" and backend.native:
            continue  # its masked second pass needs transformers' module (transformers.model_code=hf)
        backend.score_token_budget = budget
        logprobs.token_logprobs.__kwdefaults__["chunk_tokens"] = chunk
        walls = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            paths[path]()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls)
        rows.append({"part": "score", "run": f"135m score x{attempts}, {path}, budget {budget}, logit chunk {chunk}",
                     "n": attempts, "wall_s": round(wall, 3), "walls_s": [round(w, 3) for w in walls],
                     "tokens": scored, "tokens_per_s": round(scored / wall),
                     "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1)})
        print(rows[-1], file=sys.stderr, flush=True)
    logprobs.token_logprobs.__kwdefaults__["chunk_tokens"] = chunk_default
    backend.close()


def part_parity(a, model: str, work: Path, rows: list, data_dir: str) -> None:
    from gsm8kctl.agent import build_messages
    from gsm8kctl.artifacts.chat import render_prompt
    from gsm8kctl.artifacts.data import load_problems
    from gsm8kctl.sampling.backends.base import SamplingParams
    from gsm8kctl.sampling.backends.transformers import TransformersBackend

    problems = load_problems("test", data_dir)[:a.parity_problems]
    eng = TransformersBackend(model, cfg_with("transformers.static_cache=true", "sampling.max_slots=32"),
                              dtype="float32")
    prompts = [render_prompt(eng.tokenizer, build_messages(p["question"]))[1] for p in problems]
    params = SamplingParams(n=1, temperature=0.0, max_tokens=a.parity_tokens)
    got = [o[0].token_ids for o in eng.generate(prompts, params)]
    eng.close()
    dyn = TransformersBackend(model, cfg_with("transformers.static_cache=false", "sampling.batch_size=32"),
                              dtype="float32")
    ref = [o[0].token_ids for o in dyn.generate(prompts, params)]
    dyn.close()
    same = sum(x == y for x, y in zip(got, ref))
    rows.append({"part": "parity", "run": f"fp32 greedy, {len(prompts)} test prompts x {a.parity_tokens} tokens: "
                 "slot engine == dynamic path (GPU)", "n": len(prompts), "identical": same})
    Path(a.out).with_suffix(".parity.json").write_text(json.dumps({"prompts": prompts, "engine": got, "dynamic": ref}))
    print(rows[-1], file=sys.stderr, flush=True)


def run_cli(args: list[str], data_dir: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "gsm8kctl", *args], capture_output=True, text=True,
                          env={**os.environ, "GSM8K_DIR": data_dir})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return wall, proc.stdout


def part_cli(a, model: str, work: Path, rows: list, data_dir: str) -> None:
    """Each decode attention of `--attentions` in turn: `sample` in a first and a second process
    (the first with Triton's kernel cache emptied: a cold start), then `evaluate` twice."""
    for attention in a.attentions.split(","):
        common = ["--model", model, "--backend", "transformers", "-q", f"transformers.decode_attention={attention}",
                  *a.overrides]
        for run in ("first process", "second process"):
            if run == "first process" and attention == "split_k":
                shutil.rmtree(Path.home() / ".triton" / "cache", ignore_errors=True)
                run = "first process, empty Triton cache"
            tapes = work / f"sample-{attention}-{run.split()[0]}" / "tapes.jsonl"
            wall, _ = run_cli(["sample", *common, "-o", str(tapes), "--n-problems", str(a.problems), "--attempts",
                               "8", "--temperature", "1.0", "--max-tokens", str(a.max_tokens)], data_dir)
            _, out = run_cli(["stats", "--json", str(tapes)], data_dir)
            s = json.loads(out)
            gen = round(s["tokens"]["completion"]["mean"] * s["count"])
            rows.append({"part": "cli", "run": f"gsm8kctl sample {a.problems} x 8, T=1, {attention}, {run}",
                         "n": s["count"], "wall_s": round(wall, 1), "tokens": gen, "tokens_per_s": round(gen / wall),
                         "accuracy_strict": s["accuracy_strict"], "format_rate": s["format_rate"]})
            print(rows[-1], file=sys.stderr, flush=True)
        for run in ("first process", "second process"):
            wall, out = run_cli(["evaluate", *common, "-o", str(work / f"eval-{attention}-{run.split()[0]}"),
                                 "--json"], data_dir)
            m = json.loads(out)
            gen = round(m["mean_output_tokens"] * m["n"])
            rows.append({"part": "cli", "run": f"gsm8kctl evaluate (whole test split, greedy), {attention}, {run}",
                         "n": m["n"], "wall_s": round(wall, 1), "tokens": gen, "tokens_per_s": round(gen / wall),
                         "accuracy_strict": m["accuracy_strict"], "accuracy_lenient": m["accuracy_lenient"],
                         "format_rate": m["format_rate"]})
            print(rows[-1], file=sys.stderr, flush=True)


def part_generate(a, model: str, work: Path, rows: list, data_dir: str) -> None:
    """The same work through `model.generate` with a static cache, batch `--generate-batch`."""
    import torch
    from transformers import AutoModelForCausalLM

    from gsm8kctl.agent import build_messages
    from gsm8kctl.artifacts.chat import render_prompt
    from gsm8kctl.artifacts.data import load_problems
    from gsm8kctl.artifacts.models import load_tokenizer, stop_token_ids

    tok = load_tokenizer(model)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    problems = load_problems("train", data_dir)[:a.problems]
    prompts = [render_prompt(tok, build_messages(p["question"]))[1] for p in problems for _ in range(8)]
    stops = stop_token_ids(tok)
    pad = int(tok.pad_token_id)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    generated = 0
    for start in range(0, len(prompts), a.generate_batch):
        batch = prompts[start:start + a.generate_batch]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad)
        attn = torch.zeros_like(ids)
        for r, p in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(p)
            attn[r, width - len(p):] = 1
        out = m.generate(input_ids=ids.cuda(), attention_mask=attn.cuda(), do_sample=True, temperature=1.0,
                         top_p=1.0, top_k=0, max_new_tokens=a.max_tokens, cache_implementation="static",
                         eos_token_id=stops, pad_token_id=pad)
        new = out[:, width:].tolist()
        for row in new:  # count up to and including the first stop token, as the engine does
            n = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            generated += n
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rows.append({"part": "generate", "run": f"model.generate static cache, {len(prompts)} prompts, batch "
                 f"{a.generate_batch} (compile included)", "n": len(prompts), "wall_s": round(wall, 1),
                 "tokens": generated, "tokens_per_s": round(generated / wall)})
    print(rows[-1], file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="shapes")
    ap.add_argument("--gguf")
    ap.add_argument("--model")
    ap.add_argument("--tokenizer", help="tokenizer dir for the random-init shapes (default: the model)")
    ap.add_argument("--data-dir", default=os.environ.get("GSM8K_DIR"))
    ap.add_argument("--out", default="bench_gpu_sampling.json")
    ap.add_argument("--problems", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--shape-attempts-135m", type=int, default=8192)
    ap.add_argument("--shape-attempts-15b", type=int, default=2048)
    ap.add_argument("--parity-problems", type=int, default=64)
    ap.add_argument("--parity-tokens", type=int, default=256)
    ap.add_argument("--generate-batch", type=int, default=1024)
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value) for the shapes and cli parts")
    ap.add_argument("--attentions", default="split_k,flash", help="decode attentions the cli part runs, in turn")
    a = ap.parse_intermixed_args()
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    model = a.model
    if a.gguf:
        from gsm8kctl.artifacts.models import convert_gguf

        model = str(work / "model")
        convert_gguf(Path(a.gguf), Path(model))
    a.tokenizer = a.tokenizer or model
    parts = a.parts.split(",")
    rows: list[dict] = []
    out = Path(a.out)
    for part in parts:
        try:
            if part == "shapes":
                part_shapes(a, work, rows)
            elif part == "score":
                part_score(a, work, rows)
            elif part == "parity":
                part_parity(a, model, work, rows, a.data_dir)
            elif part == "cli":
                part_cli(a, model, work, rows, a.data_dir)
            elif part == "generate":
                part_generate(a, model, work, rows, a.data_dir)
            else:
                raise SystemExit(f"unknown part {part}")
        finally:  # what ran is kept even when a later part fails
            import torch

            out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=2))
    keys = ["part", "run", "n", "wall_s", "tokens", "tokens_per_s"]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))


if __name__ == "__main__":
    main()

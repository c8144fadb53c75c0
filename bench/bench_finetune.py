"""Training throughput of `gsm8kctl finetune` on random-init models of fixed shapes.

    python bench/bench_finetune.py --shape tiny --steps 3 --batch 4 --seq 128 --out bf.json   # CPU check
    python bench/bench_finetune.py --shape 135m,1.5b --batch 32 --seq 1024 --steps 6 --out bf.json
    python bench/bench_finetune.py --shape 135m --num-processes 1,2 --batch 32 --out bf.json   # 1 vs 2 GPUs
    python bench/bench_finetune.py --shape 135m --batch 64 --lengths 150-700 --packing false,true \
        --steps 12 --set finetune.token_budget=8192 --out bf_var.json   # padded vs packed, GSM8k-like lengths

For each shape (× each process count) this:

1. builds a random-init LlamaForCausalLM directory of that shape (seeded, so every run of a shape
   trains the same weights) with a tokenizer: --tokenizer, else SmolLM2's from
   `resolve_model("smollm2-135m")`, else the directory in $TOKENIZER, else a synthesized word-level one.
   The tokenizer's vocabulary need not match the model's (the 1.5B shape has 151936 rows);
   only token ids < the model's vocab_size matter, and they are drawn below min(vocab, 49152);
2. writes `batch × steps` synthetic samples of exactly --seq tokens (prompt = seq/4, the rest
   completion, with old_logprobs, weights ±1), so each optimizer step sees fresh samples and
   one micro-batch per process; with --lengths MIN-MAX each sample's length is drawn uniformly
   from that range instead (seeded), as real completions vary;
   --packing runs each value of finetune.packing (padded rows vs samples end to end);
3. calls the real `run_finetune` (objective grpo by default) on a fresh OUT, with
   finetune.train_batch_size = batch / processes (--batch is the *global* batch, so 1- and
   2-process runs train identical steps and their losses are comparable),
   token_budget = train_batch_size × seq, seq_length = seq, one checkpoint save at the end;
4. reads OUT/finetune/metrics.jsonl.

Reported per run: parameters (tied embeddings counted once), global batch, tokens/s (median of
the per-step tokens_per_s over steps ≥ 3: the first steps include torch.compile; all steps if
fewer than 3), MFU = 6 · params · tokens/s ÷ (peak FLOP/s × processes) (CUDA only; peak
defaults to 790e12, H200 bf16), peak memory (GPU: torch.cuda.max_memory_allocated of rank 0,
as metrics.jsonl records it; CPU: peak RSS of this process tree), loss per step, training s
(sum of step times) and wall s (the whole run_finetune call: model load, compile, steps, the
final checkpoint save). The markdown table goes to stdout, progress to stderr, JSON to --out.

Model directories are kept under --workdir (reused when the shape matches); run outputs
(checkpoints are fp32 weights + AdamW state: ~18 GB for 1.5B) are deleted unless --keep-outputs.
Without --workdir a temporary directory is used and removed at exit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchutil import PeakRSS  # bench/ is on sys.path when a script in it runs

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Llama shapes. 135m = SmolLM2-135M; 1.5b = Qwen2.5-1.5B-like (tied embeddings, GQA 12/2);
# tiny = a CPU-sized model for checking the script.
SHAPES: dict[str, dict] = {
    "tiny": dict(vocab_size=8192, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, head_dim=64),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, head_dim=128),
}
DEFAULT_PEAK_FLOPS = 790e12  # H200 bf16 dense, as used for MFU throughout this project
TOKEN_ID_CAP = 49152  # synthetic token ids are drawn below min(vocab_size, this)
FIRST_TIMED_STEP = 3  # steps 1-2 include compilation / warm-up


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _split_list(values: list[str]) -> list[str]:
    """Repeatable, comma-separated option values -> flat list, order kept, duplicates dropped."""
    out: list[str] = []
    for v in values:
        for part in v.split(","):
            part = part.strip()
            if part and part not in out:
                out.append(part)
    return out


# ---------------------------------------------------------------------------------------------
# Peak memory


# ---------------------------------------------------------------------------------------------
# Inputs: tokenizer, model directory, samples


def load_bench_tokenizer(path: str | None):
    """--tokenizer, else SmolLM2's (embedded model), else $TOKENIZER, else a synthesized one."""
    from transformers import AutoTokenizer

    candidates: list[tuple[str, object]] = []
    if path:
        candidates.append((path, lambda: path))
    else:
        def smollm2():
            from gsm8kctl.artifacts.models import resolve_model

            return resolve_model("smollm2-135m")  # cached dir, or a GGUF conversion (needs gguf)

        candidates.append(("smollm2-135m", smollm2))
        if os.environ.get("TOKENIZER"):  # as bench/gpu/prepare.sh exports it
            candidates.append(("$TOKENIZER", lambda: os.environ["TOKENIZER"]))
    for name, where in candidates:
        try:
            src = where()
            tok = AutoTokenizer.from_pretrained(src)
        except Exception as exc:  # noqa: BLE001 - any failure means: try the next source
            if path:
                raise
            _log(f"tokenizer: {name} unavailable ({type(exc).__name__}: {str(exc)[:120]})")
            continue
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok, f"{name} ({src})"
    return _synth_tokenizer(), "synthesized word-level"


def _synth_tokenizer():
    """A minimal fast tokenizer (pad/eos/unk + 1000 words): enough to save, load and pad."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": 3 + i for i in range(1000)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def build_model(shape: str, root: Path, tokenizer, seq: int) -> tuple[str, int]:
    """Random-init model directory of `shape` (reused when its spec matches); (path, params)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=max(4096, seq),
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 1)
    out = root / f"model-{shape}"
    marker = out / "bench_spec.json"
    if marker.exists():
        saved = json.loads(marker.read_text())
        if saved.get("spec") == spec:
            _log(f"[{shape}] reusing {out}")
            return str(out), int(saved["params"])
        shutil.rmtree(out)
    t0 = time.perf_counter()
    cfg = LlamaConfig(**spec)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())  # shared (tied) tensors once
    tmp = root / f".model-{shape}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)  # training loads fp32
    tokenizer.save_pretrained(tmp)
    (tmp / "bench_spec.json").write_text(json.dumps({"spec": spec, "params": params}))
    os.replace(tmp, out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    _log(f"[{shape}] built {params / 1e6:.1f}M-parameter model in {time.perf_counter() - t0:.1f} s")
    return str(out), params


def make_samples(root: Path, n: int, seq: int, id_cap: int, lengths: tuple[int, int] | None = None) -> str:
    """n samples of `seq` tokens (or of a length drawn from `lengths`): prompt a quarter,
    completion with old_logprobs, weight ±1."""
    tag = f"{lengths[0]}-{lengths[1]}" if lengths else str(seq)
    path = root / f"samples-{n}x{tag}-v{id_cap}.jsonl"
    if path.exists():
        return str(path)
    rng = random.Random(0)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(n):
            if lengths:
                seq = rng.randint(*lengths)
            prompt = max(1, seq // 4)
            comp = seq - prompt
            sign = 1.0 if i % 2 else -1.0
            f.write(json.dumps({
                "id": f"s{i}", "problem_id": f"p{i // 8}", "group_id": f"g{i // 8}",
                "input_ids": [rng.randrange(100, id_cap) for _ in range(seq)], "prompt_len": prompt,
                "old_logprobs": [round(rng.uniform(-12.0, -9.0), 3) for _ in range(comp)],
                "ref_logprobs": None, "reward": float(i % 2), "advantage": sign, "weight": sign,
            }) + "\n")
    os.replace(tmp, path)
    return str(path)


# ---------------------------------------------------------------------------------------------
# One run


def run_one(shape: str, nproc: int, model_dir: str, params: int, samples: str, root: Path,
            args, packing: str = "auto") -> dict:
    import torch

    from gsm8kctl.config import load_config
    from gsm8kctl.stages.finetune import run_finetune
    from gsm8kctl.training.trainer.trainer import _compile_wanted

    cuda = torch.cuda.is_available()
    per_proc = args.batch // nproc
    cfg = load_config(overrides=[
        "use_rejection_sampling=false",
        f"finetune.train_batch_size={per_proc}",
        "finetune.gradient_accumulation_passes=1",
        f"finetune.token_budget={per_proc * args.seq}",
        f"finetune.seq_length={args.seq}",
        f"finetune.compile={args.compile}",
        f"finetune.packing={packing}",
        "finetune.save_checkpoint_steps=1000000",  # one save, at the last step
        "finetune.keep_checkpoints=1",
        *args.set,
    ])
    out = root / f"out-{shape}-p{nproc}-{packing}"
    shutil.rmtree(out, ignore_errors=True)  # a leftover checkpoint would resume (and do nothing)
    row = {"shape": shape, "processes": nproc, "params": params, "global_batch": args.batch,
           "batch_per_process": per_proc, "seq": args.seq, "steps": args.steps,
           "objective": args.objective, "compile": args.compile, "packing": packing,
           "lengths": args.lengths,
           "compiled": _compile_wanted(cfg["finetune"]["compile"], cuda)}
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    _log(f"[{shape} x{nproc}] finetune: global batch {args.batch} x {args.seq} tokens, "
         f"{args.steps} steps, objective {args.objective}, compile {args.compile}")
    t0 = time.perf_counter()
    with PeakRSS() as rss:
        run_finetune([samples], str(out), cfg, init=model_dir, objective=args.objective,
                     num_processes=nproc, steps=args.steps, quiet=not args.verbose)
    row["wall_s"] = round(time.perf_counter() - t0, 1)

    metrics = [json.loads(line) for line in
               (out / "finetune" / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    timed = [m for m in metrics if m["step"] >= FIRST_TIMED_STEP] or metrics
    tps = statistics.median(m["tokens_per_s"] for m in timed)
    row.update({
        "tokens_per_s": round(tps, 1),
        "timed_steps": [m["step"] for m in timed],
        "train_s": round(sum(m["time_s"] for m in metrics), 2),
        "mfu": round(6 * params * tps / (args.peak_flops * nproc), 4) if cuda else None,
        "peak_mem_gb": (metrics[-1].get("max_mem_gb") if cuda else round(rss.peak / 2**30, 2)),
        "peak_mem_kind": "cuda max_memory_allocated (rank 0)" if cuda else "RSS (process tree)",
        "losses": [m["loss"] for m in metrics],
        "per_step": [{k: m.get(k) for k in ("step", "loss", "grad_norm", "tokens", "tokens_per_s",
                                             "time_s", "micro_batches", "clip_frac",
                                             "drift_old_new", "max_mem_gb")} for m in metrics],
    })
    if not args.keep_outputs:
        shutil.rmtree(out, ignore_errors=True)
    _log(f"[{shape} x{nproc}] {row['tokens_per_s']:.0f} tok/s, wall {row['wall_s']} s")
    return row


# ---------------------------------------------------------------------------------------------
# Report


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def markdown(rows: list[dict]) -> str:
    head = ["shape", "procs", "params", "global batch", "seq", "compiled", "packing", "tok/s (med, step≥3)",
            "MFU", "peak mem GB", "train s", "wall s", "loss per step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['processes']} | | {r.get('global_batch', '')} | "
                         f"{r.get('seq', '')} | | | FAILED: {r['error'][:80]} | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        losses = " ".join(f"{x:.5f}" for x in r["losses"])
        seq = r["lengths"] or r["seq"]
        lines.append(f"| {r['shape']} | {r['processes']} | {_fmt_params(r['params'])} | {r['global_batch']} | "
                     f"{seq} | {'yes' if r['compiled'] else 'no'} | {r['packing']} | {r['tokens_per_s']:.0f} | {mfu} | "
                     f"{r['peak_mem_gb']} | {r['train_s']} | {r['wall_s']} | {losses} |")
    return "\n".join(lines)


def environment() -> dict:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.cuda.is_available(),
           "cpu_count": os.cpu_count(), "host": platform.node()}
    if env["cuda"]:
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", action="append", default=[],
                   help=f"model shape(s): {', '.join(SHAPES)}; repeatable or comma list (default 135m)")
    p.add_argument("--batch", type=int, default=32, help="global batch (samples per optimizer step)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sample (all samples this long)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    p.add_argument("--compile", default="auto", choices=("auto", "true", "false"),
                   help="finetune.compile (auto = on CUDA)")
    p.add_argument("--num-processes", action="append", default=[],
                   help="processes per run (>1: accelerate relaunch); repeatable or comma list (default 1)")
    p.add_argument("--lengths", help="MIN-MAX: sample lengths drawn uniformly from this range (default: all --seq)")
    p.add_argument("--packing", action="append", default=[],
                   help="finetune.packing value(s) to run: auto, true, false; comma list (default auto)")
    p.add_argument("--objective", default="grpo", choices=("grpo", "reinforce", "sft"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override, e.g. finetune.logprob_chunk_tokens=4096 (repeatable)")
    p.add_argument("--peak-flops", type=float, default=DEFAULT_PEAK_FLOPS,
                   help="peak FLOP/s of one GPU for MFU (default 790e12, H200 bf16)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: SmolLM2's, see above)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--workdir", help="models, samples and run outputs (default: a temp dir, removed)")
    p.add_argument("--keep-outputs", action="store_true", help="keep each run's OUT (checkpoints)")
    p.add_argument("--verbose", action="store_true", help="finetune's own per-step output")
    args = p.parse_args(argv)
    args.shape = _split_list(args.shape) or ["135m"]
    bad = [s for s in args.shape if s not in SHAPES]
    if bad:
        p.error(f"unknown shape(s) {', '.join(bad)}; choose from {', '.join(SHAPES)}")
    try:
        args.num_processes = [int(n) for n in _split_list(args.num_processes)] or [1]
    except ValueError:
        p.error("--num-processes takes integers")
    for n in args.num_processes:
        if n < 1 or args.batch % n:
            p.error(f"--batch {args.batch} must be a positive multiple of --num-processes {n}")
    args.packing = _split_list(args.packing) or ["auto"]
    if any(v not in ("auto", "true", "false") for v in args.packing):
        p.error("--packing takes auto, true or false")
    if args.lengths:
        try:
            lo, hi = (int(x) for x in args.lengths.split("-"))
        except ValueError:
            p.error("--lengths takes MIN-MAX, e.g. 150-700")
        if not 2 <= lo <= hi:
            p.error("--lengths needs 2 <= MIN <= MAX")
        args.lengths_range = (lo, hi)
        args.seq = max(args.seq, hi)
    else:
        args.lengths_range = None
    if args.seq < 2 or args.steps < 1 or args.batch < 1:
        p.error("--seq must be >= 2, --steps and --batch >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # accelerate workers run `python -m gsm8kctl.stages.finetune`: make sure they import this tree.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    own_tmp = args.workdir is None
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-finetune-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    rows: list[dict] = []
    try:
        env = environment()
        _log(f"bench_finetune: {env.get('gpus') or 'CPU'}; torch {env['torch']}; workdir {root}")
        tokenizer, tok_source = load_bench_tokenizer(args.tokenizer)
        _log(f"tokenizer: {tok_source}")
        for shape in args.shape:
            try:
                model_dir, params = build_model(shape, root, tokenizer, args.seq)
                id_cap = min(SHAPES[shape]["vocab_size"], TOKEN_ID_CAP)
                samples = make_samples(root, args.batch * args.steps, args.seq, id_cap, args.lengths_range)
            except Exception as exc:  # noqa: BLE001 - report and go on with the next shape
                for n in args.num_processes:
                    rows.append({"shape": shape, "processes": n, "error": f"{type(exc).__name__}: {exc}"})
                _log(f"[{shape}] setup FAILED: {type(exc).__name__}: {exc}")
                continue
            for nproc, packing in [(n, v) for n in args.num_processes for v in args.packing]:
                try:
                    rows.append(run_one(shape, nproc, model_dir, params, samples, root, args, packing))
                except Exception as exc:  # noqa: BLE001
                    rows.append({"shape": shape, "processes": nproc, "global_batch": args.batch,
                                 "seq": args.seq, "error": f"{type(exc).__name__}: {exc}"})
                    _log(f"[{shape} x{nproc}] FAILED: {type(exc).__name__}: {exc}")
        table = markdown(rows)
        print(table, flush=True)
        if args.out:
            result = {"env": env, "tokenizer": tok_source,
                      "args": {k: v for k, v in vars(args).items() if k not in ("out",)},
                      "total_wall_s": round(time.perf_counter() - t_start, 1),
                      "results": rows, "table": table}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
            _log(f"wrote {args.out}")
    finally:
        if own_tmp:
            shutil.rmtree(root, ignore_errors=True)
    _log(f"total {time.perf_counter() - t_start:.1f} s")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

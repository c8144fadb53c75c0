"""`finetune`: train the latest checkpoint on training samples (objectives in `gsm8kctl.losses`).

Layout under OUT (the run directory; the loop passes `runs/NAME`; paths, the checkpoint list,
`latest`, pruning and the `keep` marker live in `gsm8kctl/rundir.py`):

    OUT/checkpoints/step-000008/      a Hugging Face model directory, loadable by transformers and
        model.safetensors             vLLM: weights (fp32 master weights: exact resume), config,
        config.json, tokenizer...     generation config, tokenizer + chat template
        finetune.yaml                 resolved config that trained it
        training_state/state.json     step, data phase + position, seed, schedule
        training_state/optimizer.pt   AdamW state
        training_state/rng-<rank>.pt  RNG states of every process
    OUT/checkpoints/latest            text: the newest complete checkpoint's name (atomic rewrite)
    OUT/finetune/metrics.jsonl        one line per optimizer step
    OUT/finetune/dataset_stats.jsonl  one line per data phase: statistics of its samples

A checkpoint is written to a hidden temp directory and renamed, then `latest` is rewritten: a
kill at any moment leaves the previous checkpoint intact. Saves come every
`finetune.save_checkpoint_steps` steps (null: only at the end of the phase). The last
`finetune.keep_checkpoints` are kept, plus any directory holding a file named `keep` (the loop
marks its best this way).

Where training starts: the latest checkpoint in OUT (weights *and* training state), else
`--init` (weights only), else the config's base model. A newer checkpoint in OUT always wins
over `--init`, and the message says so (the system this replaces silently restarted from the
base model).

Data phases and steps. Every distinct samples set (by content fingerprint) is a *phase* that
starts at the global step where it was first seen. An optimizer step consumes a global batch of
`train_batch_size × gradient_accumulation_passes × processes` samples, shuffled per epoch by
(seed, fingerprint, epoch). Each process takes an equal share (dealt by length) and packs it
into micro-batches of ≤ `train_batch_size` samples and ≤ `token_budget` padded tokens, so a
long batch makes more passes instead of running out of memory. The loss is normalised by the
completion tokens of the whole step (`losses` docstring), so micro-batching and the number of
processes do not change the result. A phase runs `finetune.steps` steps (null: `epochs` passes
over its samples); `max_steps` caps the global step. Restarted with the same samples, finetune
continues the phase from its saved position; an already finished phase is a no-op.

Multi-process: `num_processes > 1` relaunches this module under `accelerate launch` (CPU: gloo,
GPU: NCCL) with the process-group timeout from `finetune.nccl_timeout_s`; gradients are
all-reduced once per optimizer step (`no_sync` on the other passes), so long accumulation never
waits on a collective.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from array import array
from datetime import timedelta
from pathlib import Path
from typing import Sequence

from gsm8kctl.config import save_config
from gsm8kctl.errors import UserError
from gsm8kctl.jsonl import JsonlAppender, atomic_write_json, read_jsonl, write_jsonl
from gsm8kctl.paths import check_output_dir, is_inside, same_file
from gsm8kctl.procs import free_port
from gsm8kctl.rundir import (CHECKPOINTS_DIR, FINETUNE_DIR, OPTIMIZER_FILE, TRAINING_STATE_DIR,
                             TRAINING_STATE_FILE, checkpoint_step, checkpoint_tmp, latest_checkpoint,
                             publish_checkpoint)
from gsm8kctl.samples import read_samples, samples_stats, stats_table

METRICS_FILE = "metrics.jsonl"
DATASET_STATS_FILE = "dataset_stats.jsonl"
LAUNCH_FILE = "launch.json"
RESULT_FILE = "last_run.json"
CONFIG_COPY = "finetune.yaml"
OBJECTIVES = ("sft", "reinforce", "grpo")


# ---------------------------------------------------------------------------------------------
# Pure helpers: objective, schedule, data plan


def resolve_objective(cfg: dict, objective: str | None = None) -> str:
    """--objective, else finetune.objective, else sft under rejection sampling, else rl.algo."""
    obj = objective or cfg["finetune"]["objective"]
    if obj is None:
        obj = "sft" if cfg["use_rejection_sampling"] else cfg["finetune"]["rl"]["algo"]
    if obj not in OBJECTIVES:
        raise UserError(f"unknown objective '{obj}'; choose one of: {', '.join(OBJECTIVES)}")
    return obj


def lr_at(step: int, *, base: float, schedule: str, warmup: int, horizon: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then constant or cosine to 0 at `horizon`."""
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    if schedule == "constant":
        return base
    progress = min(1.0, max(0.0, (step - warmup) / max(1, horizon - warmup)))
    return base * 0.5 * (1.0 + math.cos(math.pi * progress))


def fingerprint(samples: Sequence[dict]) -> str:
    """Content hash of a samples set: ids, token ids, spans and weights (order matters)."""
    h = hashlib.sha1()
    for s in samples:
        h.update(str(s["id"]).encode("utf-8") + b"\0")
        h.update(array("q", s["input_ids"]).tobytes())
        h.update(f"|{s['prompt_len']}|{float(s['weight'])!r}|{float(s['reward'])!r}\n".encode())
    return h.hexdigest()[:16]


def global_batch_size(ft: dict, world: int) -> int:
    """Samples per optimizer step: train_batch_size × gradient_accumulation_passes × processes."""
    return int(ft["train_batch_size"]) * int(ft["gradient_accumulation_passes"]) * world


def steps_per_epoch(n_samples: int, global_batch: int) -> int:
    """Optimizer steps of one pass over n samples (the last step takes the remainder)."""
    return math.ceil(n_samples / global_batch)


def step_batches(n: int, global_batch: int, seed: int, fp: str, epoch: int) -> list[list[int]]:
    """Sample indices of each optimizer step of one epoch (the last step may be smaller)."""
    order = list(range(n))
    random.Random(f"{seed}:{fp}:{epoch}").shuffle(order)
    return [order[i:i + global_batch] for i in range(0, n, global_batch)]


def micro_batches(indices: list[int], lengths: Sequence[int], rank: int, world: int,
                  token_budget: int, max_batch: int) -> list[list[int]]:
    """This process's share of one step, packed into micro-batches by the token budget.

    Dealing by sorted length (rank r takes every world-th) balances tokens across processes.
    """
    from gsm8kctl.logprobs import token_budget_batches

    mine = sorted(indices, key=lambda i: (lengths[i], i))[rank::world]
    groups = token_budget_batches([lengths[i] for i in mine], token_budget, max_batch)
    return [[mine[j] for j in g] for g in groups]


# ---------------------------------------------------------------------------------------------
# The stage


def run_finetune(
    samples_paths: Sequence[str],
    out: str,
    cfg: dict,
    *,
    init: str | None = None,
    objective: str | None = None,
    num_processes: int | None = None,
    steps: int | None = None,
    max_steps: int | None = None,
    metrics_path: str | None = None,
    quiet: bool = False,
    stop_after: int | None = None,
) -> dict:
    """`gsm8kctl finetune`: train on the samples, save under OUT; returns a summary dict.

    Inputs are checked here, before any worker starts, so bad input is one clear UserError.
    `stop_after` (single process) ends this invocation after N steps and a save, as a kill would.
    """
    from gsm8kctl.config import set_value

    cfg = json.loads(json.dumps(cfg))  # our copy: options below are recorded in it
    if steps is not None:
        set_value(cfg, "finetune.steps", steps)
    if max_steps is not None:
        set_value(cfg, "finetune.max_steps", max_steps)
    if num_processes is not None:
        set_value(cfg, "finetune.num_processes", num_processes)
    objective = resolve_objective(cfg, objective)
    set_value(cfg, "finetune.objective", objective)
    ft = cfg["finetune"]
    _check_finetune_config(ft)
    out_dir = Path(out)
    _check_out(out_dir, samples_paths, cfg)

    start, resume, note = _resolve_start(out_dir, init, cfg)
    samples = _load_and_check(samples_paths, start, cfg, objective)
    if not quiet:
        _say(note)

    nproc = int(ft["num_processes"])
    in_worker = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if nproc > 1 and not in_worker:
        return _launch(samples_paths, samples, out_dir, cfg, start=start, resume=resume,
                       metrics_path=metrics_path, quiet=quiet)
    return train(samples, out_dir, cfg, start=start, resume=resume, metrics_path=metrics_path,
                 quiet=quiet, source=[str(p) for p in samples_paths], stop_after=stop_after)


def _check_out(out_dir: Path, samples_paths: Sequence[str], cfg: dict) -> None:
    """--out is a writable run directory that is not an input, and holds no input where it rewrites."""
    for src in samples_paths:
        if src != "-" and same_file(out_dir, src):
            raise UserError(f"{out_dir}: --out is the input samples file {src}; --out takes a run directory")
    check_output_dir(out_dir, option="--out", data_dir=cfg.get("data_dir"))
    for src in samples_paths:
        # Checkpoints are pruned and finetune/ files rewritten: an input kept there would be lost.
        for sub in (CHECKPOINTS_DIR, FINETUNE_DIR):
            if src != "-" and is_inside(src, out_dir / sub):
                raise UserError(f"{src}: an input inside {out_dir / sub}, which finetune rewrites and prunes; "
                                "move it out of the run directory's checkpoints/ and finetune/")


def _check_finetune_config(ft: dict) -> None:
    for key in ("train_batch_size", "gradient_accumulation_passes", "token_budget", "seq_length",
                "logprob_chunk_tokens", "num_processes", "epochs"):
        if not isinstance(ft[key], int) or ft[key] < 1:
            raise UserError(f"finetune.{key} must be a positive integer, got {ft[key]!r}")
    every = ft["save_checkpoint_steps"]
    if every is not None and (not isinstance(every, int) or every < 1):
        raise UserError(f"finetune.save_checkpoint_steps must be null or a positive integer, got {every!r}")
    for key in ("steps", "max_steps"):
        if ft[key] is not None and (not isinstance(ft[key], int) or ft[key] < 0):
            raise UserError(f"finetune.{key} must be null or a non-negative integer, got {ft[key]!r}")
    if ft["lr_scheduler"] not in ("constant", "cosine"):
        raise UserError(f"finetune.lr_scheduler must be constant or cosine, got '{ft['lr_scheduler']}'")
    if ft["dtype"] not in ("auto", "float32", "bfloat16"):
        raise UserError(f"finetune.dtype must be auto, float32 or bfloat16, got '{ft['dtype']}'")
    _compile_wanted(ft["compile"], False)
    if ft["keep_checkpoints"] < 1:
        raise UserError("finetune.keep_checkpoints must be at least 1")


def _resolve_start(out_dir: Path, init: str | None, cfg: dict) -> tuple[str, bool, str]:
    """(model dir to load, resume training state?, message): latest checkpoint > --init > base."""
    from gsm8kctl.models import resolve_model

    ckpt = latest_checkpoint(out_dir)
    if ckpt is not None:
        note = f"resuming from {ckpt} (step {checkpoint_step(ckpt)})"
        if init and Path(resolve_model(init)).resolve() != ckpt.resolve():
            note += (f"; --init {init} ignored because {out_dir} already has a newer checkpoint "
                     "(use a fresh --out to start over)")
        return str(ckpt), True, note
    if init:
        path = resolve_model(init)
        return path, False, f"starting from --init {init} ({path}), step 0"
    path = resolve_model(cfg["model"])
    return path, False, f"starting from the base model {cfg['model']} ({path}), step 0"


def _vocab_size(start: str) -> int | None:
    """The model's vocabulary size, from its config.json when it has one: importing transformers
    (and torch) takes seconds, and bad samples should be refused before that."""
    try:
        return int(json.loads((Path(start) / "config.json").read_text(encoding="utf-8"))["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(start).vocab_size)
    except Exception:  # a hub id we cannot read offline: the model load will say more
        return None


def _load_and_check(paths: Sequence[str], start: str, cfg: dict, objective: str) -> list[dict]:
    ft = cfg["finetune"]
    if Path(start).is_dir() and not any((Path(start) / f).exists()
                                        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise UserError(f"{start}: no tokenizer files; checkpoints must carry their tokenizer "
                        "(save it next to the weights, or start from a complete model directory)")
    vocab = _vocab_size(start)
    samples = read_samples(paths, seq_length=ft["seq_length"], vocab_size=vocab)
    if objective == "grpo":
        n = sum(s.get("old_logprobs") is None for s in samples)
        if n:
            raise UserError(f"objective grpo needs the sampler's old_logprobs; {n} of {len(samples)} "
                            "samples have none (gold samples, or a backend without logprobs): "
                            "use --objective reinforce or sft")
    if float(ft["rl"]["kl_coef"]):
        n = sum(s.get("ref_logprobs") is None for s in samples)
        if n:
            raise UserError(f"finetune.rl.kl_coef > 0 needs ref_logprobs; {n} of {len(samples)} samples "
                            "have none: run filter with --ref-model")
    return samples


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Multi-process: relaunch this module under `accelerate launch`


def _launch(paths, samples, out_dir: Path, cfg: dict, *, start: str, resume: bool,
            metrics_path: str | None, quiet: bool) -> dict:
    import torch

    nproc = int(cfg["finetune"]["num_processes"])
    fdir = out_dir / FINETUNE_DIR
    fdir.mkdir(parents=True, exist_ok=True)
    if any(str(p) == "-" for p in paths):
        # Workers cannot share our stdin: spool what we read.
        spooled = fdir / "stdin-samples.jsonl"
        write_jsonl(spooled, samples)
        paths = [str(spooled)]
    spec = {"samples": [str(Path(p).resolve()) for p in paths], "out": str(out_dir.resolve()),
            "cfg": cfg, "start": start, "resume": resume, "quiet": quiet,
            "metrics_path": str(Path(metrics_path).resolve()) if metrics_path else None}
    atomic_write_json(fdir / LAUNCH_FILE, spec)
    (fdir / RESULT_FILE).unlink(missing_ok=True)
    mp = "bf16" if _use_bf16(cfg["finetune"]["dtype"], torch.cuda.is_available()) else "no"
    # --multi_gpu selects accelerate's torchrun launcher; without CUDA it runs MULTI_CPU (gloo).
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision", mp,
           "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           "-m", "gsm8kctl.stages.finetune", str(fdir / LAUNCH_FILE)]
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if not quiet:
        _say(f"launching {nproc} processes: {' '.join(cmd[1:4])} ...")
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        if rc == 2:
            raise UserError("finetune workers rejected their input (message above)")
        raise RuntimeError(f"finetune workers failed with exit code {rc} (see their output above)")
    return json.loads((fdir / RESULT_FILE).read_text(encoding="utf-8"))


def _worker_main(argv: list[str]) -> int:
    """Entry of each `accelerate launch` worker: read the launch spec, train."""
    from gsm8kctl.errors import EXIT_BAD_INPUT

    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    try:
        samples = read_samples(spec["samples"], seq_length=spec["cfg"]["finetune"]["seq_length"])
        train(samples, Path(spec["out"]), spec["cfg"], start=spec["start"], resume=spec["resume"],
              metrics_path=spec["metrics_path"], quiet=spec["quiet"], source=spec["samples"])
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


# ---------------------------------------------------------------------------------------------
# Training


def _use_bf16(dtype: str, cuda: bool) -> bool:
    return dtype == "bfloat16" or (dtype == "auto" and cuda)


def _compile_wanted(value, cuda: bool) -> bool:
    """finetune.compile: auto = on CUDA only (on CPU compiling costs more than it saves)."""
    v = str(value).strip().lower()
    if v == "auto":
        return cuda
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off", "none"):
        return False
    raise UserError(f"finetune.compile must be auto, true or false, got {value!r}")


def _make_policy_module(lm, chunk_tokens: int):
    """DDP only syncs gradients of a forward it ran: wrap the chunked log-prob pass as one module."""
    import torch

    from gsm8kctl.logprobs import token_logprobs

    class PolicyLogprobs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask, score_mask):
            return token_logprobs(self.lm, input_ids, attention_mask, score_mask,
                                  chunk_tokens=chunk_tokens, with_entropy=True)

    return PolicyLogprobs()


def _rng_state() -> dict:
    import torch

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    with contextlib.suppress(ImportError):
        import numpy as np

        state["numpy"] = np.random.get_state()
    return state


def _set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _per_token(rows: list[list[float] | None], lengths: list[int], prompt_lens: list[int], width: int):
    """[B, T] tensor with each row's completion values at its completion positions, and a mask."""
    import torch

    vals = torch.zeros((len(rows), width), dtype=torch.float32)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (r, n, pl) in enumerate(zip(rows, lengths, prompt_lens)):
        if r is not None:
            vals[i, pl:n] = torch.tensor(r, dtype=torch.float32)
            mask[i, pl:n] = True
    return vals, mask


def train(samples: list[dict], out_dir: Path, cfg: dict, *, start: str, resume: bool,
          metrics_path: str | None = None, quiet: bool = False, source: Sequence[str] = (),
          stop_after: int | None = None) -> dict:
    """The training loop, top to bottom. `stop_after` ends this invocation after that many
    optimizer steps, as if killed right after a save (tests of resume use it)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from gsm8kctl import losses
    from gsm8kctl.logprobs import pad_batch
    from gsm8kctl.models import load_tokenizer

    ft, rl = cfg["finetune"], cfg["finetune"]["rl"]
    objective = ft["objective"]
    out_dir = Path(out_dir)
    hf_logging.disable_progress_bar()  # per-shard load/save bars say nothing useful here

    # ----------------------------------------------------------------------------------------
    # Init: processes, precision, seed
    cuda = torch.cuda.is_available()
    bf16 = _use_bf16(ft["dtype"], cuda)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        _reset_accelerate()  # an earlier in-process run may have fixed other precision settings
    accelerator = Accelerator(
        cpu=not cuda,
        mixed_precision="bf16" if bf16 else "no",
        # The process-group timeout: a long accumulation must not trip a collective's watchdog.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=int(ft["nccl_timeout_s"])))],
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    main = accelerator.is_main_process
    device = accelerator.device
    quiet = quiet or not main
    set_seed(int(cfg["seed"]) + rank)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # ----------------------------------------------------------------------------------------
    # Training state: step, data phase and position (optimizer and RNG once the model exists)
    fp = fingerprint(samples)
    global_batch = global_batch_size(ft, world)
    step, phase_start, state = 0, 0, None
    sdir = Path(start) / TRAINING_STATE_DIR
    if resume:
        state = json.loads((sdir / TRAINING_STATE_FILE).read_text(encoding="utf-8"))
        step = int(state["step"])
        same_phase = state["phase"]["fingerprint"] == fp
        phase_start = int(state["phase"]["start_step"]) if same_phase else step
        if same_phase and state.get("global_batch") != global_batch and not quiet:
            _say(f"warning: global batch changed ({state.get('global_batch')} -> {global_batch}); "
                 "the data position is kept in steps, not samples")
    per_epoch = steps_per_epoch(len(samples), global_batch)
    phase_steps = int(ft["steps"]) if ft["steps"] is not None else int(ft["epochs"]) * per_epoch
    target = phase_start + phase_steps
    if ft["max_steps"] is not None:
        target = min(target, int(ft["max_steps"]))
    # Cosine decays to 0 at max_steps, or at the end of this samples set when there is no cap.
    horizon = int(ft["max_steps"]) if ft["max_steps"] is not None else target
    if step >= target:
        if not quiet:
            _say(f"nothing to do: step {step} already reached the target {target}")
        return _finish(accelerator, out_dir, step, target, phase_start, None, ran=0)

    # ----------------------------------------------------------------------------------------
    # Model and tokenizer. fp32 master weights always; bf16 only inside autocast.
    lm = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    lm.config.use_cache = False
    if ft["gradient_checkpointing"]:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = _compile_wanted(ft["compile"], cuda)
    if compiled:
        # Compiling each decoder layer fuses norms, rotary and activations: on an H200 the 1.5B
        # shape went from 36k to 50k tokens/s and from 132 to 94 GB at batch 32 x 1024.
        # Layers compile in place, so state-dict names (and saved checkpoints) are unchanged.
        layers = getattr(lm.get_decoder(), "layers", None)
        if layers is None:
            _say("warning: finetune.compile: this model has no decoder.layers; running eagerly")
        else:
            for layer in layers:
                layer.compile()
    tokenizer = load_tokenizer(start)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model = _make_policy_module(lm, int(ft["logprob_chunk_tokens"])).to(device)
    model.train()

    # ----------------------------------------------------------------------------------------
    # Optimizer: AdamW; no weight decay on norms and biases (1-d tensors).
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": float(ft["weight_decay"])},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=float(ft["learning_rate"]), betas=(0.9, 0.999), eps=1e-8, fused=cuda,
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    if resume:
        optimizer.load_state_dict(torch.load(sdir / OPTIMIZER_FILE, map_location=device, weights_only=False))
        rng_file = sdir / f"rng-{rank}.pt"
        if rng_file.exists():  # absent when the process count changed
            _set_rng_state(torch.load(rng_file, weights_only=False))

    # ----------------------------------------------------------------------------------------
    # Output files, dataset statistics (printed and saved once per phase)
    fdir = out_dir / FINETUNE_DIR
    metrics_file = Path(metrics_path) if metrics_path else fdir / METRICS_FILE
    stats = samples_stats(samples)
    if main:
        fdir.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(metrics_file, step)  # steps after the saved state are redone
        _record_phase(fdir / DATASET_STATS_FILE, {"phase": fp, "start_step": phase_start,
                                                  "sources": list(source), **stats})
    if not quiet:
        from rich.console import Console

        console = Console(stderr=True)
        console.print(stats_table(stats, title=f"finetune samples (phase {fp})"))
        _say(f"objective {objective}; {len(samples)} samples, {global_batch} per step on {world} "
             f"process(es); steps {step} -> {target} (phase from step {phase_start}); "
             f"{'bf16 autocast' if bf16 else 'fp32'} on {device}")
    accelerator.wait_for_everyone()

    lengths = [len(s["input_ids"]) for s in samples]
    comp_tokens = [len(s["input_ids"]) - s["prompt_len"] for s in samples]
    lr_kwargs = dict(base=float(ft["learning_rate"]), schedule=ft["lr_scheduler"],
                     warmup=int(ft["warmup_steps"]), horizon=horizon)
    clip = float(ft["gradient_clipping_threshold"] or 0.0)
    autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if bf16
                else contextlib.nullcontext())
    metrics_out = JsonlAppender(metrics_file, fsync_every=1) if main else None
    ran, last = 0, None

    # ----------------------------------------------------------------------------------------
    # The loop: one optimizer step per iteration
    while step < target:
        t0 = time.perf_counter()
        epoch, pos = divmod(step - phase_start, per_epoch)
        step_idx = step_batches(len(samples), global_batch, int(cfg["seed"]), fp, epoch)[pos]
        mbs = micro_batches(step_idx, lengths, rank, world, int(ft["token_budget"]), int(ft["train_batch_size"]))
        dummy = not mbs  # fewer samples than processes: run one zero-weight pass to join the all-reduce
        if dummy:
            mbs = [step_idx[:1]]
        # Exact token mean over the step; DDP averages gradients over processes, hence × world.
        normalizer = sum(comp_tokens[i] for i in step_idx) / world
        sums: dict = {}
        for k, mb in enumerate(mbs):
            batch = [samples[i] for i in mb]
            plens = [s["prompt_len"] for s in batch]
            ids, attn, comp = pad_batch([s["input_ids"][:s["prompt_len"]] for s in batch],
                                        [s["input_ids"][s["prompt_len"]:] for s in batch], pad_id, device)
            width, blens = ids.shape[1], [len(s["input_ids"]) for s in batch]
            old, old_mask = _per_token([s.get("old_logprobs") for s in batch], blens, plens, width)
            ref, ref_mask = _per_token([s.get("ref_logprobs") for s in batch], blens, plens, width)
            has_old, has_ref = bool(old_mask.any()), bool(ref_mask.any())
            weights = torch.tensor([float(s["weight"]) for s in batch], device=device)
            sync = k == len(mbs) - 1
            # Forward and backward both inside no_sync: DDP decides in forward whether to all-reduce.
            with (contextlib.nullcontext() if sync else accelerator.no_sync(model)):
                with autocast:
                    new, entropy = model(ids, attn, comp)
                loss, part = losses.policy_loss(
                    new, comp, objective=objective, weights=weights,
                    old=old.to(device) if has_old else None, old_mask=old_mask.to(device),
                    ref=ref.to(device) if has_ref else None, ref_mask=ref_mask.to(device),
                    epsilon=float(rl["epsilon"]), kl_coef=float(rl["kl_coef"]),
                    relu_weights=bool(rl["relu_weights"]), normalizer=normalizer,
                )
                if dummy:
                    loss = loss * 0.0
                accelerator.backward(loss)
            if dummy:
                continue
            part["entropy_sum"] = (entropy.detach() * comp).sum()
            part["samples"] = torch.tensor(float(len(batch)), device=device)
            part["real_tokens"] = torch.tensor(float(sum(blens)), device=device)
            if has_old and epoch == 0:
                # First pass over the data: how far the trainer's log-probs are from the sampler's.
                om = old_mask.to(device)
                part["drift_sum"] = ((new.detach() - old.to(device)).abs() * om).sum()
                part["drift_tokens"] = om.sum().float()
            losses.add_sums(sums, part)

        grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        lr = lr_at(step, **lr_kwargs)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        ran += 1

        # ---- metrics: one all-reduce of the summed statistics per step (after the sync pass)
        keys = ("tokens", "loss_sum", "ratio_sum", "ratio_tokens", "clipped", "kl_sum", "kl_tokens",
                "entropy_sum", "samples", "real_tokens", "drift_sum", "drift_tokens")
        vec = torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float32, device=device).reshape(())
                           for k in keys])
        vec = accelerator.reduce(vec, reduction="sum") if world > 1 else vec
        total = dict(zip(keys, vec.tolist()))
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        means = losses.summarize({k: v for k, v in total.items()
                                  if k in ("tokens", "loss_sum", "ratio_sum", "ratio_tokens", "kl_sum",
                                           "kl_tokens") or (k == "clipped" and objective == "grpo")})
        last = {
            "step": step, "epoch": epoch, "phase": fp, "loss": means["loss_per_token"], "lr": lr,
            "grad_norm": float(grad_norm), "tokens": int(total["real_tokens"]),
            "completion_tokens": int(total["tokens"]), "samples": int(total["samples"]),
            "tokens_per_s": round(total["real_tokens"] / dt, 1), "samples_per_s": round(total["samples"] / dt, 3),
            "ratio_mean": means["ratio_mean"], "clip_frac": means["clip_frac"], "kl": means["kl"],
            "entropy": total["entropy_sum"] / total["tokens"] if total["tokens"] else None,
            "drift_old_new": total["drift_sum"] / total["drift_tokens"] if total["drift_tokens"] else None,
            "micro_batches": len(mbs), "time_s": round(dt, 4),
            "max_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        }
        if metrics_out is not None:
            metrics_out.write(last)
        if not quiet:
            _say(f"step {step}/{target} loss {last['loss']:.4f} lr {lr:.3g} grad {last['grad_norm']:.3f} "
                 f"{last['tokens_per_s']:.0f} tok/s")

        # ---- save
        every = ft["save_checkpoint_steps"]
        if (every and step % int(every) == 0) or step == target:
            _save(accelerator, model, optimizer, tokenizer, cfg, out_dir, step=step,
                  phase={"fingerprint": fp, "start_step": phase_start, "n_samples": len(samples),
                         "sources": list(source)},
                  global_batch=global_batch)
            if stop_after is not None and ran >= stop_after:
                break
    if metrics_out is not None:
        metrics_out.close()
    del model, optimizer, lm  # free the GPU before returning: the caller may train again in-process
    return _finish(accelerator, out_dir, step, target, phase_start, last, ran=ran, compiled=compiled)


def _finish(accelerator, out_dir: Path, step: int, target: int, phase_start: int, last, *, ran: int,
            compiled: bool = False) -> dict:
    ckpt = latest_checkpoint(out_dir)
    result = {"step": step, "target": target, "phase_start": phase_start, "steps_run": ran,
              "checkpoint": str(ckpt) if ckpt else None, "last_metrics": last}
    if accelerator.is_main_process and accelerator.num_processes > 1:
        atomic_write_json(out_dir / FINETUNE_DIR / RESULT_FILE, result)
    accelerator.wait_for_everyone()
    if compiled:
        import torch

        torch._dynamo.reset()  # compiled graphs hold the model's weights alive
    accelerator.free_memory()  # drops accelerate's references to model and optimizer, empties caches
    accelerator.end_training()
    if accelerator.num_processes == 1:
        _reset_accelerate()
    return result


def _reset_accelerate() -> None:
    """Forget accelerate's process-wide state, so the next in-process run may change precision."""
    from accelerate.state import AcceleratorState

    with contextlib.suppress(Exception):
        AcceleratorState._reset_state(True)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines of steps after `step` (they are redone after a resume)."""
    if not path.exists():
        return
    rows = list(read_jsonl(path, repair_tail=True))
    kept = [r for r in rows if int(r.get("step", 0)) <= step]
    if len(kept) != len(rows) or path.read_bytes()[-1:] not in (b"\n", b""):
        write_jsonl(path, kept)


def _record_phase(path: Path, record: dict) -> None:
    """Append the phase's dataset statistics unless this phase is already recorded."""
    if path.exists():
        for r in read_jsonl(path, repair_tail=True):
            if r.get("phase") == record["phase"] and r.get("start_step") == record["start_step"]:
                return
    with JsonlAppender(path) as f:
        f.write(record)


def _save(accelerator, model, optimizer, tokenizer, cfg: dict, out_dir: Path, *, step: int,
          phase: dict, global_batch: int) -> Path:
    """Write checkpoint `step` to a temp dir, rename it into place, point `latest` at it, prune."""
    import torch

    tmp = checkpoint_tmp(out_dir, step)
    main = accelerator.is_main_process
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / TRAINING_STATE_DIR).mkdir(parents=True)
    accelerator.wait_for_everyone()
    if main:
        lm = accelerator.unwrap_model(model).lm
        lm.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        save_config(cfg, tmp / CONFIG_COPY)
        torch.save(optimizer.state_dict(), tmp / TRAINING_STATE_DIR / OPTIMIZER_FILE)
    torch.save(_rng_state(), tmp / TRAINING_STATE_DIR / f"rng-{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    final = None
    if main:
        # The state file last: a checkpoint without it is incomplete and never loaded.
        atomic_write_json(tmp / TRAINING_STATE_DIR / TRAINING_STATE_FILE, {
            "step": step, "phase": phase, "global_batch": global_batch, "seed": cfg["seed"],
            "objective": cfg["finetune"]["objective"], "num_processes": accelerator.num_processes,
            "created": round(time.time(), 3),
        })
        final = publish_checkpoint(out_dir, tmp, step, int(cfg["finetune"]["keep_checkpoints"]))
    accelerator.wait_for_everyone()
    return final


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))

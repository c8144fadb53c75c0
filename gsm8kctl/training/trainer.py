"""The trainer: the policy, its optimizer and the data plan, shared by `finetune` and the loop.

Data phases and steps. Every distinct samples set (by content fingerprint) is a *phase* that
starts at the global step where it was first seen. An optimizer step consumes a global batch of
`train_batch_size × gradient_accumulation_passes × processes` samples, shuffled per epoch by
(seed, fingerprint, epoch). Each process takes an equal share (dealt by length) and packs it
into micro-batches of ≤ `train_batch_size` samples and ≤ `token_budget` padded tokens, so a
long batch makes more passes instead of running out of memory. The loss is normalised by the
completion tokens of the whole step (`losses` docstring), so micro-batching and the number of
processes do not change the result. A phase runs `finetune.steps` steps (null: `epochs` passes
over its samples); `max_steps` caps the global step. Restarted with the same samples, training
continues the phase from its saved position; an already finished phase is a no-op.

Pieces, used top to bottom by `finetune` (one phase per process) and by the loop's in-process
engine (one `Trainer` for the whole run): `plan_phase` (the data plan), `Trainer.train_step`
(one optimizer step), `Trainer.save` (the checkpoint, layout in `rundir.py`).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import random
import shutil
import threading
import time
from array import array
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Sequence

from gsm8kctl import oom
from gsm8kctl.artifacts.jsonl import JsonlAppender, atomic_write_json, read_jsonl, write_jsonl
from gsm8kctl.artifacts.rundir import (DATASET_STATS_FILE, FINETUNE_DIR, FINETUNE_METRICS_FILE, FINETUNE_RESULT_FILE,
                                       OPTIMIZER_FILE, TRAINING_STATE_DIR, TRAINING_STATE_FILE, checkpoint_dir,
                                       checkpoint_tmp, latest_checkpoint, publish_checkpoint, training_state)
from gsm8kctl.artifacts.samples import samples_stats, stats_table
from gsm8kctl.config import save_config
from gsm8kctl.config.sizes import gpu_share
from gsm8kctl.errors import UserError
from gsm8kctl.progress import console, say, warn

CONFIG_COPY = "finetune.yaml"


# ---------------------------------------------------------------------------------------------
# Pure helpers: schedule, data order


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


def _opt_float(x) -> float | None:
    return None if x is None else float(x)


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
                  token_budget: int, max_batch: int, *, packed: bool = False) -> list[list[int]]:
    """This process's share of one step, grouped into micro-batches by the token budget.

    Dealing by sorted length (rank r takes every world-th) balances tokens across processes.
    """
    from gsm8kctl.training.logprobs import token_budget_batches

    mine = sorted(indices, key=lambda i: (lengths[i], i))[rank::world]
    groups = token_budget_batches([lengths[i] for i in mine], token_budget, max_batch, packed=packed)
    return [[mine[j] for j in g] for g in groups]


# ---------------------------------------------------------------------------------------------
# Precision, compile, the policy module, RNG


def use_bf16(dtype: str, cuda: bool) -> bool:
    return dtype == "bfloat16" or (dtype == "auto" and cuda)


def _on_cuda_by_default(key: str, value, cuda: bool) -> bool:
    """An auto | true | false setting: auto = on CUDA only."""
    v = str(value).strip().lower()
    if v == "auto":
        return cuda
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off", "none"):
        return False
    raise UserError(f"{key} must be auto, true or false, got {value!r}")


def _compile_wanted(value, cuda: bool) -> bool:
    """finetune.compile: on CPU compiling costs more than it saves."""
    return _on_cuda_by_default("finetune.compile", value, cuda)


def _packing_wanted(value, cuda: bool) -> bool:
    """finetune.packing: on CUDA padding wastes compute and every new width recompiles."""
    return _on_cuda_by_default("finetune.packing", value, cuda)


def _make_policy_module(lm, chunk_tokens: int):
    """DDP only syncs gradients of a forward it ran: wrap the chunked log-prob pass as one module."""
    import torch

    from gsm8kctl.training.logprobs import token_logprobs

    class PolicyLogprobs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask, score_mask, position_ids=None):
            return token_logprobs(self.lm, input_ids, attention_mask, score_mask, position_ids=position_ids,
                                  chunk_tokens=chunk_tokens, with_entropy=True)

    return PolicyLogprobs()


def _host_copy(obj):
    """A copy in host memory of a (nested) state dict; tensors that share storage (tied
    embeddings) still share it, so the checkpoint is written exactly as from the live model."""
    import torch

    seen: dict = {}

    def copy(x):
        if isinstance(x, torch.Tensor):
            key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.dtype)
            if key not in seen:
                seen[key] = x.detach().to("cpu", copy=True)
            return seen[key]
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(copy(v) for v in x)
        return x

    return copy(obj)


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


# ---------------------------------------------------------------------------------------------
# The data plan of one phase


@dataclass
class PhasePlan:
    """Which optimizer steps one samples set (a phase) trains, and on which samples each."""
    fingerprint: str
    phase_start: int   # the global step where this samples set was first trained
    start: int         # the global step training continues from
    target: int        # the global step this invocation stops at
    horizon: int       # where a cosine schedule reaches 0
    per_epoch: int     # steps of one pass over the samples
    global_batch: int

    @property
    def steps(self) -> int:
        return max(0, self.target - self.start)


def plan_phase(samples: Sequence[dict], ft: dict, *, step: int, last_phase: dict | None,
               last_global_batch: int | None, world: int, say=None) -> PhasePlan:
    """Continue the phase these samples belong to, or start a new one at `step`.

    `last_phase` is the phase of the training state the trainer stands at (None at step 0). The
    same samples (by fingerprint) continue it: a rerun after a crash, or a no-op once finished.
    """
    fp = fingerprint(samples)
    global_batch = global_batch_size(ft, world)
    same = last_phase is not None and last_phase["fingerprint"] == fp
    phase_start = int(last_phase["start_step"]) if same else step
    if same and last_global_batch != global_batch and say is not None:
        say(f"warning: global batch changed ({last_global_batch} -> {global_batch}); "
            "the data position is kept in steps, not samples")
    per_epoch = steps_per_epoch(len(samples), global_batch)
    phase_steps = int(ft["steps"]) if ft["steps"] is not None else int(ft["epochs"]) * per_epoch
    target = phase_start + phase_steps
    if ft["max_steps"] is not None:
        target = min(target, int(ft["max_steps"]))
    # Cosine decays to 0 at max_steps, or at the end of this samples set when there is no cap.
    horizon = int(ft["max_steps"]) if ft["max_steps"] is not None else target
    return PhasePlan(fp, phase_start, step, target, horizon, per_epoch, global_batch)


def start_state(start: str, resume: bool) -> dict | None:
    """The training state a run from `start` stands at: its step and phase (None: step 0)."""
    return training_state(start) if resume else None


# ---------------------------------------------------------------------------------------------
# The trainer


class Trainer:
    """The policy in fp32 master weights, its AdamW state and its accelerator, open across phases.

    `finetune` opens one, runs one phase and closes it. The loop's in-process engine keeps one
    open for the whole run: weights, optimizer state and compiled layers survive iterations,
    and a phase costs its optimizer steps and one checkpoint save.
    """

    def __init__(self, cfg: dict, out_dir: Path, *, start: str, resume: bool, quiet: bool = False):
        import torch
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs, set_seed
        from transformers.utils import logging as hf_logging

        from gsm8kctl.artifacts.models import load_tokenizer
        from gsm8kctl.training import packing

        ft = cfg["finetune"]
        self.out_dir = Path(out_dir)
        # The in-process engine sets this: a phase's last save writes in a thread (see `save`).
        self.background_saves = False
        self.token_budget = None  # set smaller than finetune.token_budget after an out-of-memory
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None
        self.pending: Path | None = None  # the checkpoint that thread is writing
        hf_logging.disable_progress_bar()  # per-shard load/save bars say nothing useful here

        # Processes, precision, seed
        self.cuda = torch.cuda.is_available()
        self.bf16 = use_bf16(ft["dtype"], self.cuda)
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            _reset_accelerate()  # an earlier in-process run may have fixed other precision settings
        self.accelerator = Accelerator(
            cpu=not self.cuda,
            mixed_precision="bf16" if self.bf16 else "no",
            # The process-group timeout: a long accumulation must not trip a collective's watchdog.
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=int(ft["nccl_timeout_s"])))],
        )
        acc = self.accelerator
        self.rank, self.world, self.main = acc.process_index, acc.num_processes, acc.is_main_process
        self.device = acc.device
        self.quiet = quiet or not self.main
        set_seed(int(cfg["seed"]) + self.rank)
        if self.cuda:
            oom.keep_to_share(gpu_share(cfg))
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

        # Where training stands: step and data phase (optimizer and RNG once the model exists)
        state = start_state(start, resume)
        self.step = int(state["step"]) if state else 0
        self.phase = state["phase"] if state else None
        self.saved_global_batch = state.get("global_batch") if state else None

        self.lm = self._load_model(start, ft)
        # Packed micro-batches (gsm8kctl/training/packing.py): flash varlen attention on CUDA in bf16,
        # causal SDPA per sample elsewhere.
        self.packed = _packing_wanted(ft["packing"], self.cuda)
        self.flash = self.packed and packing.flash_available(self.device, self.bf16)
        self.tokenizer = load_tokenizer(start)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        model = _make_policy_module(self.lm, int(ft["logprob_chunk_tokens"])).to(self.device)
        model.train()

        # Optimizer: AdamW; no weight decay on norms and biases (1-d tensors).
        decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": float(ft["weight_decay"])},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=float(ft["learning_rate"]), betas=(0.9, 0.999), eps=1e-8, fused=self.cuda,
        )
        self.model, self.optimizer = acc.prepare(model, optimizer)
        if resume:
            self._load_training_state(Path(start) / TRAINING_STATE_DIR)

    def _load_model(self, start: str, ft: dict):
        """The model in fp32 (master weights; bf16 only inside autocast), its layers compiled
        where finetune.compile asks for it."""
        import torch
        from transformers import AutoModelForCausalLM

        from gsm8kctl.artifacts.models import check_transformers_reads

        check_transformers_reads(start)
        lm = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
        lm.config.use_cache = False
        if ft["gradient_checkpointing"]:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.compiled = _compile_wanted(ft["compile"], self.cuda)
        if self.compiled:
            # Compiling each decoder layer fuses norms, rotary and activations: on one H200
            # (2026-11-29) the 1.5B shape went from 36k to 50k tokens/s and from 132 to 94 GB at
            # batch 32 x 1024.
            # Layers compile in place, so state-dict names (and saved checkpoints) are unchanged.
            layers = getattr(lm.get_decoder(), "layers", None)
            if layers is None:
                warn("finetune.compile: this model has no decoder.layers; running eagerly")
            else:
                for layer in layers:
                    layer.compile()
        return lm

    def _load_training_state(self, sdir: Path) -> None:
        """The optimizer's moments and this rank's RNG state of the checkpoint resumed from."""
        import torch

        # Under gloo the device is `cpu:0`, which torch.load cannot map to; the optimizer moves
        # each state tensor to its parameter's device anyway.
        where = self.device if self.device.type == "cuda" else "cpu"
        self.optimizer.load_state_dict(torch.load(sdir / OPTIMIZER_FILE, map_location=where, weights_only=False))
        rng_file = sdir / f"rng-{self.rank}.pt"
        if rng_file.exists():  # absent when the process count changed
            _set_rng_state(torch.load(rng_file, weights_only=False))

    def plan(self, samples: Sequence[dict], ft: dict) -> PhasePlan:
        return plan_phase(samples, ft, step=self.step, last_phase=self.phase,
                          last_global_batch=self.saved_global_batch, world=self.world,
                          say=None if self.quiet else say)

    # ------------------------------------------------------------------ one phase
    def run(self, samples: list[dict], cfg: dict, *, metrics_path: str | None = None,
            source: Sequence[str] = (), stop_after: int | None = None) -> dict:
        """Train one phase, top to bottom: stats, then one optimizer step per iteration, saves.
        `stop_after` ends after that many steps and a save, as if killed then (resume tests)."""
        ft = cfg["finetune"]
        plan = self.plan(samples, ft)
        if plan.steps == 0:
            if not self.quiet:
                say(f"nothing to do: step {self.step} already reached the target {plan.target}")
            return self.result(plan, None, ran=0)

        # A budget halved by an out-of-memory is tried at twice its size in the next phase: the
        # memory may be back (a neighbour's peak has passed), and a halved budget kept for good
        # made every later phase several times slower.
        if self.token_budget is not None:
            self.token_budget = min(2 * self.token_budget, int(ft["token_budget"]))

        # Output files, dataset statistics (printed and saved once per phase)
        fdir = self.out_dir / FINETUNE_DIR
        metrics_file = Path(metrics_path) if metrics_path else fdir / FINETUNE_METRICS_FILE
        stats = samples_stats(samples)
        if self.main:
            fdir.mkdir(parents=True, exist_ok=True)
            _truncate_metrics(metrics_file, self.step)  # steps after the saved state are redone
            _record_phase(fdir / DATASET_STATS_FILE, {"phase": plan.fingerprint, "start_step": plan.phase_start,
                                                      "sources": list(source), **stats})
        if not self.quiet:
            console.print(stats_table(stats, title=f"finetune samples (phase {plan.fingerprint})"))
            say(f"objective {ft['objective']}; {len(samples)} samples, {plan.global_batch} per step on "
                f"{self.world} process(es); steps {self.step} -> {plan.target} (phase from step "
                f"{plan.phase_start}); {'bf16 autocast' if self.bf16 else 'fp32'} on {self.device}; "
                f"{('packed, flash varlen' if self.flash else 'packed') if self.packed else 'padded'} micro-batches")
        self.accelerator.wait_for_everyone()

        metrics_out = JsonlAppender(metrics_file, fsync_every=1) if self.main else None
        ran, last = 0, None
        phase = {"fingerprint": plan.fingerprint, "start_step": plan.phase_start, "n_samples": len(samples),
                 "sources": list(source)}
        while self.step < plan.target:
            last = self.train_step(samples, cfg, plan)
            ran += 1
            if metrics_out is not None:
                metrics_out.write(last)
            if not self.quiet:
                say(f"step {self.step}/{plan.target} loss {last['loss']:.4f} lr {last['lr']:.3g} "
                    f"grad {last['grad_norm']:.3f} {last['tokens_per_s']:.0f} tok/s")
            every = ft["save_checkpoint_steps"]
            if (every and self.step % int(every) == 0) or self.step == plan.target:
                self.save(cfg, phase, plan.global_batch,
                          background=self.background_saves and self.step == plan.target and stop_after is None)
                if stop_after is not None and ran >= stop_after:
                    break
        if metrics_out is not None:
            metrics_out.close()
        return self.result(plan, last, ran=ran)

    def train_step(self, samples: list[dict], cfg: dict, plan: PhasePlan) -> dict:
        """One optimizer step over the step's global batch; returns its metrics line."""
        import torch

        from gsm8kctl.training import losses

        ft, objective = cfg["finetune"], cfg["finetune"]["objective"]
        acc, model, device, world = self.accelerator, self.model, self.device, self.world
        t0 = time.perf_counter()
        lengths = [len(s["input_ids"]) for s in samples]
        epoch, pos = divmod(self.step - plan.phase_start, plan.per_epoch)
        step_idx = step_batches(len(samples), plan.global_batch, int(cfg["seed"]), plan.fingerprint, epoch)[pos]
        # Exact token mean over the step; DDP averages gradients over processes, hence × world.
        normalizer = sum(len(samples[i]["input_ids"]) - samples[i]["prompt_len"] for i in step_idx) / world
        # Out of memory: the same samples again in micro-batches of half the tokens (gsm8kctl/oom.py).
        budget, retries = self.token_budget or int(ft["token_budget"]), []
        while True:
            mbs = micro_batches(step_idx, lengths, self.rank, world, budget, int(ft["train_batch_size"]),
                                packed=self.packed)
            dummy = not mbs  # fewer samples than processes: run one zero-weight pass to join the all-reduce
            if dummy:
                mbs = [step_idx[:1]]
            failed = False
            try:
                sums = self._accumulate(samples, mbs, cfg, epoch=epoch, normalizer=normalizer, dummy=dummy)
            except Exception as exc:  # noqa: BLE001 - only an out-of-memory is handled
                if not oom.is_oom(exc):
                    raise
                failed = True
            if not failed:
                break
            self.optimizer.zero_grad(set_to_none=True)  # what the failed micro-batches accumulated
            oom.release()
            if world > 1 or all(len(mb) == 1 for mb in mbs):  # ranks must agree; one sample is the floor
                raise oom.OutOfMemory(oom.describe(f"finetune step {self.step + 1} (micro-batches of "
                                                   f"{budget} tokens)"))
            budget = max(1, budget // 2)
            retries.append(f"out of memory in finetune step {self.step + 1}: retried in micro-batches of "
                           f"{budget} tokens")
            oom.retried(retries[-1])
        self.token_budget = budget  # later steps keep the size that fits

        clip = float(ft["gradient_clipping_threshold"] or 0.0)
        grad_norm = acc.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        lr = lr_at(self.step, base=float(ft["learning_rate"]), schedule=ft["lr_scheduler"],
                   warmup=int(ft["warmup_steps"]), horizon=plan.horizon)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

        # One all-reduce of the summed statistics per step (after the sync pass)
        keys = ("tokens", "loss_sum", "ratio_sum", "ratio_tokens", "clipped", "kl_sum", "kl_tokens",
                "entropy_sum", "samples", "real_tokens", "drift_sum", "drift_tokens")
        vec = torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float32, device=device).reshape(())
                           for k in keys])
        vec = acc.reduce(vec, reduction="sum") if world > 1 else vec
        total = dict(zip(keys, vec.tolist()))
        if self.cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        means = losses.summarize({k: v for k, v in total.items()
                                  if k in ("tokens", "loss_sum", "ratio_sum", "ratio_tokens", "kl_sum",
                                           "kl_tokens") or (k == "clipped" and objective == "grpo")})
        return {
            "step": self.step, "epoch": epoch, "phase": plan.fingerprint, "loss": means["loss_per_token"], "lr": lr,
            "grad_norm": float(grad_norm), "tokens": int(total["real_tokens"]),
            "completion_tokens": int(total["tokens"]), "samples": int(total["samples"]),
            "tokens_per_s": round(total["real_tokens"] / dt, 1), "samples_per_s": round(total["samples"] / dt, 3),
            "ratio_mean": means["ratio_mean"], "clip_frac": means["clip_frac"], "kl": means["kl"],
            "entropy": total["entropy_sum"] / total["tokens"] if total["tokens"] else None,
            "drift_old_new": total["drift_sum"] / total["drift_tokens"] if total["drift_tokens"] else None,
            "micro_batches": len(mbs), "packing": ("flash" if self.flash else "sdpa") if self.packed else None,
            **({"oom_retries": retries} if retries else {}),
            "time_s": round(dt, 4),
            "max_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if self.cuda else None,
        }

    def _accumulate(self, samples: list[dict], mbs: list[list[int]], cfg: dict, *, epoch: int,
                    normalizer: float, dummy: bool) -> dict:
        """Forward and backward over the step's micro-batches, gradients accumulated; the summed
        statistics of the step on this process."""
        import torch

        from gsm8kctl.training import losses

        from gsm8kctl.training import packing
        from gsm8kctl.training.logprobs import pad_batch

        rl, objective = cfg["finetune"]["rl"], cfg["finetune"]["objective"]
        acc, model, device = self.accelerator, self.model, self.device
        autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if self.bf16
                    else contextlib.nullcontext())
        sums: dict = {}
        for k, mb in enumerate(mbs):
            batch = [samples[i] for i in mb]
            plens = [s["prompt_len"] for s in batch]
            ids, attn, comp = pad_batch([s["input_ids"][:s["prompt_len"]] for s in batch],
                                        [s["input_ids"][s["prompt_len"]:] for s in batch], self.pad_id, device)
            width, blens = ids.shape[1], [len(s["input_ids"]) for s in batch]
            old, old_mask = _per_token([s.get("old_logprobs") for s in batch], blens, plens, width)
            ref, ref_mask = _per_token([s.get("ref_logprobs") for s in batch], blens, plens, width)
            has_old, has_ref = bool(old_mask.any()), bool(ref_mask.any())
            weights = torch.tensor([float(s["weight"]) for s in batch], device=device)
            sync = k == len(mbs) - 1
            row = None
            if self.packed:
                row = packing.pack([s["input_ids"][:s["prompt_len"]] for s in batch],
                                   [s["input_ids"][s["prompt_len"]:] for s in batch], device)
            # Forward and backward both inside no_sync: DDP decides in forward whether to all-reduce.
            # Backward inside the packed segments too: gradient checkpointing runs attention again.
            with (contextlib.nullcontext() if sync else acc.no_sync(model)), \
                    (packing.segments(self.lm, row, flash=self.flash) if row else contextlib.nullcontext()):
                with autocast:
                    if row is None:
                        new, entropy = model(ids, attn, comp)
                    else:
                        new, entropy = model(row.ids, None, row.score, row.positions)
                        new, entropy = packing.unpack(new, attn), packing.unpack(entropy, attn)
                loss, part = losses.policy_loss(
                    new, comp, objective=objective, weights=weights,
                    old=old.to(device) if has_old else None, old_mask=old_mask.to(device),
                    ref=ref.to(device) if has_ref else None, ref_mask=ref_mask.to(device),
                    epsilon=float(rl["epsilon"]), epsilon_high=_opt_float(rl["epsilon_high"]),
                    kl_coef=float(rl["kl_coef"]),
                    relu_weights=bool(rl["relu_weights"]), normalizer=normalizer,
                )
                if dummy:
                    loss = loss * 0.0
                acc.backward(loss)
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

        return sums

    # ------------------------------------------------------------------ checkpoint
    def save(self, cfg: dict, phase: dict, global_batch: int, *, background: bool = False) -> Path | None:
        """Write checkpoint `step` to a temp dir, rename it into place, point `latest` at it, prune.

        Without fsync: a kill -9 leaves the page cache intact, so the rename after the writes is
        what makes it safe; a power cut is not covered.

        `background` (one process only): the weights, the optimizer state and the RNG state are
        copied to host memory now, and a thread writes them while the caller goes on; the
        checkpoint is published (renamed into place) only when every file is written. The
        caller must `wait_saved()` before anything that needs it on disk; a kill before that
        leaves no checkpoint, and the loop redoes the phase (loop/driver.py, `pending_save`).
        """
        import torch

        self.wait_saved()
        acc, step = self.accelerator, self.step
        tmp = checkpoint_tmp(self.out_dir, step)
        if self.main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / TRAINING_STATE_DIR).mkdir(parents=True)
        acc.wait_for_everyone()
        meta = {"step": step, "phase": phase, "global_batch": global_batch, "seed": cfg["seed"],
                "objective": cfg["finetune"]["objective"], "num_processes": acc.num_processes}
        self.phase, self.saved_global_batch = phase, global_batch
        if background and self.world == 1:
            # Host copies first: the next phase may change the live tensors while the thread writes.
            weights = _host_copy(acc.unwrap_model(self.model).lm.state_dict())
            optimizer = _host_copy(self.optimizer.state_dict())
            rng = _rng_state()
            keep = int(cfg["finetune"]["keep_checkpoints"])
            self.pending = checkpoint_dir(self.out_dir, step)
            self._writer = threading.Thread(target=self._write_thread, name=f"checkpoint-{step}",
                                            args=(tmp, step, keep, cfg, weights, optimizer, rng, meta))
            self._writer.start()
            return self.pending
        if self.main:
            self._write_files(tmp, cfg, None, self.optimizer.state_dict())
        torch.save(_rng_state(), tmp / TRAINING_STATE_DIR / f"rng-{acc.process_index}.pt")
        acc.wait_for_everyone()
        final = None
        if self.main:
            final = self._publish(tmp, step, int(cfg["finetune"]["keep_checkpoints"]), meta)
        acc.wait_for_everyone()
        return final

    def _write_thread(self, tmp: Path, step: int, keep: int, cfg: dict, weights: dict, optimizer: dict,
                      rng: dict, meta: dict) -> None:
        import torch

        try:
            self._write_files(tmp, cfg, weights, optimizer)
            torch.save(rng, tmp / TRAINING_STATE_DIR / "rng-0.pt")
            self._publish(tmp, step, keep, meta)
        except BaseException as exc:  # re-raised in the caller's thread by wait_saved
            self._writer_error = exc

    def _write_files(self, tmp: Path, cfg: dict, weights: dict | None, optimizer: dict) -> None:
        """A checkpoint's files but the RNG states and the state file: the weights (`weights`, a
        host copy, or None for the live model's), tokenizer, config and optimizer state."""
        import torch

        self.lm.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        self.tokenizer.save_pretrained(tmp)
        save_config(cfg, tmp / CONFIG_COPY)
        torch.save(optimizer, tmp / TRAINING_STATE_DIR / OPTIMIZER_FILE)

    def _publish(self, tmp: Path, step: int, keep: int, meta: dict) -> Path:
        """The state file last (a checkpoint without it is incomplete and never loaded), then the
        directory renamed into place, `latest` pointed at it and older ones pruned."""
        atomic_write_json(tmp / TRAINING_STATE_DIR / TRAINING_STATE_FILE, {**meta, "created": round(time.time(), 3)})
        return publish_checkpoint(self.out_dir, tmp, step, keep)

    def wait_saved(self) -> float:
        """Block until a background save is on disk (published); the seconds waited."""
        t0 = time.perf_counter()
        if self._writer is not None:
            self._writer.join()
            self._writer, self.pending = None, None
        if self._writer_error is not None:
            exc, self._writer_error = self._writer_error, None
            raise exc
        return time.perf_counter() - t0

    def result(self, plan: PhasePlan, last: dict | None, *, ran: int) -> dict:
        ckpt = self.pending or latest_checkpoint(self.out_dir)
        result = {"step": self.step, "target": plan.target, "phase_start": plan.phase_start, "steps_run": ran,
                  "checkpoint": str(ckpt) if ckpt else None, "last_metrics": last}
        if self.main and self.world > 1:
            atomic_write_json(self.out_dir / FINETUNE_DIR / FINETUNE_RESULT_FILE, result)
        self.accelerator.wait_for_everyone()
        return result

    def close(self) -> None:
        """Free the GPU: the caller may train or sample again in this process."""
        import torch

        self.wait_saved()
        acc = self.accelerator
        del self.model, self.optimizer, self.lm
        if self.compiled:
            torch._dynamo.reset()  # compiled graphs hold the model's weights alive
        acc.free_memory()  # drops accelerate's references to model and optimizer, empties caches
        acc.end_training()
        if acc.num_processes == 1:
            _reset_accelerate()


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

"""`finetune`: train the latest checkpoint on training samples (objectives in `gsm8kctl.training.losses`).

Layout under OUT (the run directory; the loop passes `runs/NAME`; paths, the checkpoint list,
`latest`, pruning and the `keep` marker live in `gsm8kctl/artifacts/rundir.py`):

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

Data phases, steps and the training loop itself are in `gsm8kctl/training/trainer.py`.

Multi-process: `num_processes > 1` relaunches this module under `accelerate launch` (CPU: gloo,
GPU: NCCL) with the process-group timeout from `finetune.nccl_timeout_s`; gradients are
all-reduced once per optimizer step (`no_sync` on the other passes), so long accumulation never
waits on a collective.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Sequence

from gsm8kctl.artifacts.jsonl import atomic_write_json, write_jsonl
from gsm8kctl.artifacts.paths import check_output_dir, is_inside, same_file
from gsm8kctl.artifacts.rundir import (CHECKPOINTS_DIR, FINETUNE_DIR, FINETUNE_RESULT_FILE, LAUNCH_FILE,
                                       checkpoint_step, latest_checkpoint)
from gsm8kctl.artifacts.samples import read_samples
from gsm8kctl.errors import StageFailed, UserError
from gsm8kctl.procs import call_child, free_port
from gsm8kctl.progress import say, warn
from gsm8kctl.training.trainer import Trainer, use_bf16, plan_phase, start_state

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
    check_finetune_config(ft)
    out_dir = Path(out)
    _check_out(out_dir, samples_paths, cfg)

    start, resume, note = resolve_start(out_dir, init, cfg)
    kl = ft["rl"]["kl_coef"]
    samples = load_and_check(samples_paths, start, cfg, objective)
    if not resume:  # a model not ours: one line if transformers cannot read it, before any output
        from gsm8kctl.artifacts.models import check_transformers_reads

        check_transformers_reads(start)
    if kl != ft["rl"]["kl_coef"]:  # said once every check has passed: a refused run prints one line
        warn(f"finetune.rl.kl_coef={kl:g} but no sample carries ref_logprobs (filter without --ref-model): "
             "training without the KL term")
    if not quiet:
        say(note)

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


def describe_result(result: dict) -> str | None:
    """finetune's closing line, from what `run_finetune` returns (`--json` prints it whole); None
    when it trained nothing (it said so when it found out)."""
    if not result["steps_run"]:
        return None
    loss = (result.get("last_metrics") or {}).get("loss")
    said = f", last loss {loss:.4f}" if isinstance(loss, (int, float)) else ""
    return (f"finetune: {result['steps_run']} optimizer steps, now at step {result['step']} of {result['target']}"
            f"{said}; checkpoint {result['checkpoint']}")


def check_finetune_config(ft: dict) -> None:
    """The finetune section against the schema once more: a caller from Python may hand over a
    dict that `load_config` never saw, and a bad value must stop before any worker starts."""
    from gsm8kctl.config import schema

    for key, problem in schema.check_config(ft, schema.Finetune, "finetune."):
        raise UserError(f"config: {key} {problem}")


def resolve_start(out_dir: Path, init: str | None, cfg: dict) -> tuple[str, bool, str]:
    """(model dir to load, resume training state?, message): latest checkpoint > --init > base."""
    from gsm8kctl.artifacts.models import resolve_model

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


def load_and_check(paths: Sequence[str], start: str, cfg: dict, objective: str,
                   given: list[dict] | None = None) -> list[dict]:
    """The samples of `paths` (or `given`, the one file's samples already in memory), checked
    against the model `start` (its directory, its vocabulary) and what `objective` and the KL
    term need; the KL is turned off when no sample has ref log-probs (the caller says so)."""
    ft = cfg["finetune"]
    if Path(start).is_dir():  # a checkpoint resumed from did not go through resolve_model's check
        from gsm8kctl.artifacts.models import check_model_dir

        check_model_dir(Path(start))
    vocab = _vocab_size(start)
    samples = read_samples(paths, seq_length=ft["seq_length"], vocab_size=vocab, given=given)
    if objective == "grpo":
        n = sum(s.get("old_logprobs") is None for s in samples)
        if n:
            raise UserError(f"objective grpo needs the sampler's old_logprobs; {n} of {len(samples)} "
                            "samples have none (gold samples, or a backend without logprobs): "
                            "use --objective reinforce or sft")
    if float(ft["rl"]["kl_coef"]):
        n = sum(s.get("ref_logprobs") is None for s in samples)
        if n == len(samples):
            # The default config's KL term (the loop's, to its warm start) on samples filtered
            # without a reference: train without it (run_finetune says so), not refuse the pipeline.
            ft["rl"]["kl_coef"] = 0.0
        elif n:
            raise UserError(f"finetune.rl.kl_coef > 0 needs ref_logprobs; {n} of {len(samples)} samples "
                            "have none: run filter with --ref-model")
    return samples


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
    (fdir / FINETUNE_RESULT_FILE).unlink(missing_ok=True)
    mp = "bf16" if use_bf16(cfg["finetune"]["dtype"], torch.cuda.is_available()) else "no"
    # --multi_gpu selects accelerate's torchrun launcher; without CUDA it runs MULTI_CPU (gloo).
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision", mp,
           "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           "-m", "gsm8kctl.stages.finetune", str(fdir / LAUNCH_FILE)]
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if not quiet:
        say(f"launching {nproc} processes: {' '.join(cmd[1:4])} ...")
    rc = call_child(cmd, env=env)
    if rc != 0:
        if rc == 2:
            raise UserError("finetune workers rejected their input (message above)")
        # torchrun stops the other workers when one fails; a hung collective ends at nccl_timeout_s.
        raise StageFailed(f"a finetune worker failed (exit {rc}, its output is above) and the others were "
                          f"stopped; the last checkpoint in {out_dir} is intact: rerun the same command to resume")
    return json.loads((fdir / FINETUNE_RESULT_FILE).read_text(encoding="utf-8"))


def _worker_main(argv: list[str]) -> int:
    """Entry of each `accelerate launch` worker: read the launch spec, train."""
    from gsm8kctl.errors import EXIT_BAD_INPUT

    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    try:
        samples = read_samples(spec["samples"], seq_length=spec["cfg"]["finetune"]["seq_length"])
        train(samples, Path(spec["out"]), spec["cfg"], start=spec["start"], resume=spec["resume"],
              metrics_path=spec["metrics_path"], quiet=spec["quiet"], source=spec["samples"])
    except UserError as exc:
        say(f"error: {exc}", verbatim=True)
        return EXIT_BAD_INPUT
    return 0


# ---------------------------------------------------------------------------------------------
# Training: one phase in this process


def train(samples: list[dict], out_dir: Path, cfg: dict, *, start: str, resume: bool,
          metrics_path: str | None = None, quiet: bool = False, source: Sequence[str] = (),
          stop_after: int | None = None) -> dict:
    """Plan the phase, open a Trainer, run it, close it (`gsm8kctl/training/trainer.py` has the pieces).

    One process with nothing left to train returns before the model loads. `stop_after` ends
    after that many optimizer steps, as if killed right after a save (tests of resume use it).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        state = start_state(start, resume)
        plan = plan_phase(samples, cfg["finetune"], step=int(state["step"]) if state else 0,
                          last_phase=state["phase"] if state else None,
                          last_global_batch=state.get("global_batch") if state else None, world=1)
        if plan.steps == 0:
            if not quiet:
                say(f"nothing to do: step {plan.start} already reached the target {plan.target}")
            ckpt = latest_checkpoint(out_dir)
            return {"step": plan.start, "target": plan.target, "phase_start": plan.phase_start, "steps_run": 0,
                    "checkpoint": str(ckpt) if ckpt else None, "last_metrics": None}
    trainer = Trainer(cfg, Path(out_dir), start=start, resume=resume, quiet=quiet)
    try:
        return trainer.run(samples, cfg, metrics_path=metrics_path, source=source, stop_after=stop_after)
    finally:
        trainer.close()


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))

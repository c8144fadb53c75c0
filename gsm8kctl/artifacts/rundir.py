"""The run directory: where everything of a run lives, the checkpoint list, and `state.json`.

    RUN/config.yaml                     the resolved config (CONFIG_FILE)
    RUN/state.json                      what the loop does next (rewritten atomically per phase)
    RUN/.lock                           flock held by the running loop
    RUN/llm_calls.sqlite                every LLM call of every phase
    RUN/output.log                      what libraries and the phases' processes printed (without -v)
    RUN/metrics.jsonl                   one line per iteration; RUN/learning_curve.png its plot
    RUN/pass_rates.jsonl                one line per training problem sampled: its pass rate (curriculum.py)
    RUN/warmup/samples.jsonl            gold samples of the warm start
    RUN/iterations/NNNN/{tapes,samples}.jsonl
    RUN/iterations/NNNN/warnings.jsonl  out-of-memory retries of the iteration's phases (oom.py)
    RUN/eval/NNNN/{tapes.jsonl,metrics.json}        the test split (eval/start/: before the warm start)
    RUN/validation/NNNN/{tapes.jsonl,metrics.json}  the held-out validation split, same layout
    RUN/checkpoints/step-NNNNNN/        a Hugging Face model directory plus training_state/
    RUN/checkpoints/latest              text: the newest complete checkpoint's name
    RUN/checkpoints/*/keep              a marker: never pruned (the loop keeps its best)
    RUN/finetune/metrics.jsonl          one line per optimizer step

A checkpoint is complete once its `training_state/state.json` exists: it is written last, and
the directory is renamed into place after it. `finetune --out DIR` uses the same layout, so a
run directory is also a finetune output, and `--model RUN` stands for its latest checkpoint.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

from gsm8kctl.artifacts.jsonl import atomic_write_json, atomic_write_text
from gsm8kctl.errors import UserError

# Inside the run directory and the stages' outputs (one name, one owner: here).
CONFIG_FILE = "config.yaml"                  # the resolved config every stage saves beside its output
TAPES_FILE = "tapes.jsonl"
SAMPLES_FILE = "samples.jsonl"
EVAL_METRICS_FILE = "metrics.json"           # evaluate's summary of one evaluation
STATS_FILE = "stats.json"
LLM_CALLS_FILE = "llm_calls.sqlite"
FINETUNE_METRICS_FILE = "metrics.jsonl"      # finetune/: one line per optimizer step
DATASET_STATS_FILE = "dataset_stats.jsonl"   # finetune/: one line per samples set trained
FINETUNE_RESULT_FILE = "last_run.json"       # finetune/: the result of a multi-process run
LAUNCH_FILE = "launch.json"                  # finetune/: what `accelerate launch` workers read
SHARDS_DIR = "shards"                        # one sampling phase's per-process outputs
GOLD_FILE = "gold_samples.jsonl"             # control/: the SFT control's gold samples
SEEDS_SUMMARY_FILE = "seeds.json"            # seeds: per seed, and median and range
SEEDS_PLOT_FILE = "seeds.png"
CONTROL_DIR = "control"                      # seeds: RUN/seed-S/control/
STATE_FILE = "state.json"
LOCK_FILE = ".lock"
RUN_METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "learning_curve.png"
PASS_RATES_FILE = "pass_rates.jsonl"
OUTPUT_LOG_FILE = "output.log"
WARMUP_DIR = "warmup"
ITERATIONS_DIR = "iterations"
WARNINGS_FILE = "warnings.jsonl"
EVAL_DIR = "eval"
VALIDATION_DIR = "validation"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
KEEP_MARKER = "keep"
FINETUNE_DIR = "finetune"
# Inside a checkpoint: the training state, its state file written last.
TRAINING_STATE_DIR = "training_state"
TRAINING_STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"
PHASES = ("evaluate", "sample", "filter", "finetune", "record")
# filter.ref_model's name, in the loop, for the model its first iteration samples with (the
# warm-start checkpoint, or `model`): a KL to where RL began, whose path is not known beforehand.
START_MODEL = "start"


def iteration_dir(run: Path, it: int) -> Path:
    return Path(run) / ITERATIONS_DIR / f"{it:04d}"


START_ITERATION = -1  # the starting model's evaluation before the warm start (test_before_warmup)


def eval_dir(run: Path, it: int, split: str = "test") -> Path:
    """Where the loop's evaluation of iteration `it` on `split` (test or validation) lives."""
    top = VALIDATION_DIR if split == "validation" else EVAL_DIR
    return Path(run) / top / (f"{it:04d}" if it != START_ITERATION else "start")


# ---------------------------------------------------------------------------------------------
# Checkpoints


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    """Where checkpoint `step` lives once published."""
    return Path(out_dir) / CHECKPOINTS_DIR / checkpoint_name(step)


def is_complete(ckpt: Path) -> bool:
    return (ckpt / TRAINING_STATE_DIR / TRAINING_STATE_FILE).exists()


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under OUT/checkpoints, oldest first."""
    root = Path(out_dir) / CHECKPOINTS_DIR
    found = []
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and d.name.startswith("step-") and is_complete(d):
                try:
                    found.append((int(d.name[5:]), d))
                except ValueError:
                    continue
    return sorted(found)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names; if that is missing or broken, the highest complete step."""
    root = Path(out_dir) / CHECKPOINTS_DIR
    pointer = root / LATEST_FILE
    if pointer.exists():
        d = root / pointer.read_text(encoding="utf-8").strip()
        if d.name and is_complete(d):
            return d
    found = list_checkpoints(out_dir)
    return found[-1][1] if found else None


def checkpoint_step(ckpt: str | Path) -> int:
    return int(training_state(ckpt)["step"])


def training_state(ckpt: str | Path) -> dict:
    return json.loads((Path(ckpt) / TRAINING_STATE_DIR / TRAINING_STATE_FILE).read_text(encoding="utf-8"))


def checkpoint_tmp(out_dir: Path, step: int) -> Path:
    """Where a save of `step` is written before it is renamed into place."""
    return Path(out_dir) / CHECKPOINTS_DIR / f".{checkpoint_name(step)}.tmp"


def publish_checkpoint(out_dir: Path, tmp: Path, step: int, keep: int) -> Path:
    """Rename a finished temp checkpoint into place, point `latest` at it, prune the old ones."""
    final = checkpoint_dir(out_dir, step)
    if final.exists():  # a previous save of this step that was killed before `latest` moved
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(final.parent / LATEST_FILE, final.name + "\n")
    prune_checkpoints(out_dir, keep, final)
    return final


def prune_checkpoints(out_dir: Path, keep: int, current: Path) -> None:
    """Delete all but the last `keep` checkpoints (never the current one or one marked `keep`)."""
    found = list_checkpoints(out_dir)
    doomed = found[:-keep] if keep > 0 else []
    for _, d in doomed:
        if d.resolve() != current.resolve() and not (d / KEEP_MARKER).exists():
            shutil.rmtree(d, ignore_errors=True)
    # Temp directories of saves killed midway.
    for d in (Path(out_dir) / CHECKPOINTS_DIR).glob(".step-*.tmp"):
        shutil.rmtree(d, ignore_errors=True)


def is_own_checkpoint(run: Path, model: Path) -> bool:
    """A model directory that is one of this run's checkpoints (not the base model)."""
    return (model / "config.json").exists() and model.parent.resolve() == (Path(run) / CHECKPOINTS_DIR).resolve()


def mark_keep(ckpt: Path, why: str) -> None:
    (ckpt / KEEP_MARKER).write_text(why + "\n")


def unmark_keep(ckpt: Path) -> None:
    (ckpt / KEEP_MARKER).unlink(missing_ok=True)


def run_dir_of(path: Path) -> Path | None:
    """PATH itself when it is a run directory (a `checkpoints/latest` and no config.json of its own)."""
    if not (path / "config.json").exists() and (path / CHECKPOINTS_DIR / LATEST_FILE).exists():
        return path
    return None


# ---------------------------------------------------------------------------------------------
# The loop's lock and state


class RunLock:
    """An exclusive flock on RUN/.lock; the kernel drops it when the holder dies, so no stale lock."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def __enter__(self) -> "RunLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise UserError(f"{self.path.parent}: another loop (pid {holder}) is running on this run directory")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)


def load_state(run_dir: Path) -> dict:
    path = Path(run_dir) / STATE_FILE
    if not path.exists():
        return {"iteration": 0, "phase": "warmup", "cursor": 0, "problems": None, "child_pgid": None,
                "timings": {}, "best": None}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path}: not valid JSON (it is written atomically; was it edited by hand?)") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror})") from None
    return _check_state(state, path)


def _check_state(state, path: Path) -> dict:
    """The keys the loop resumes from, typed; a hand-edited or foreign file is named with its key."""
    from gsm8kctl.artifacts.jsonl import shown

    def bad(key: str, what: str):
        return UserError(f"{path}: '{key}' must be {what}, got {shown(state.get(key))} "
                         "(not a state file of this loop's; restore it or use a fresh --run-dir)")

    if not isinstance(state, dict):
        raise UserError(f"{path}: expected a JSON object (the loop's state), got {type(state).__name__}")
    for key in ("iteration", "cursor"):
        v = state.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise bad(key, "an integer >= 0")
    phases = ("warmup", *PHASES, "done")
    if state.get("phase") not in phases:
        raise bad("phase", f"one of {', '.join(phases)}")
    problems = state.get("problems")
    if problems is not None and not (isinstance(problems, list) and all(isinstance(p, str) for p in problems)):
        raise bad("problems", "null or a list of problem ids")
    if not isinstance(state.setdefault("timings", {}), dict):
        raise bad("timings", "an object")
    best = state.setdefault("best", None)
    if best is not None and not (isinstance(best, dict) and isinstance(best.get("accuracy_strict"), (int, float))):
        raise bad("best", "null or an object with accuracy_strict")
    pgid = state.setdefault("child_pgid", None)
    if pgid is not None and (not isinstance(pgid, int) or isinstance(pgid, bool)):
        raise bad("child_pgid", "null or a process group id")
    pending = state.get("pending_save")
    if pending is not None and not (isinstance(pending, dict) and isinstance(pending.get("checkpoint"), str)
                                    and pending.get("phase") in ("warmup", "finetune")
                                    and isinstance(pending.get("iteration"), int)
                                    and isinstance(pending.get("cursor"), int)):
        raise bad("pending_save", "null or an object with checkpoint, phase, iteration and cursor")
    start = state.get("start_model")
    if start is not None and not isinstance(start, str):
        raise bad("start_model", "null or the path of the model the run started from")
    state.setdefault("problems", None)
    return state


def save_state(run_dir: Path, state: dict) -> None:
    atomic_write_json(Path(run_dir) / STATE_FILE, state)

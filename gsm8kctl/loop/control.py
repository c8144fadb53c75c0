"""`control`: the SFT-only control of an RL run, token for token: what RL must beat.

From the model the RL run's first iteration sampled with (its warm start), this trains on gold
solutions of the training split (never a validation problem: the same seed holds out the same
ones) for as many completion tokens as the RL run had trained before the evaluation it is
matched at, at the RL run's own optimizer settings, then evaluates greedily on the same test and
validation problems. `--at best` matches the checkpoint the RL run chose on validation, `last`
its last evaluation, `all` every evaluation (a curve beside the run's).

    OUT/metrics.jsonl        one line per matched iteration: the loop's keys, plus the steps
                             and the token target trained to
    OUT/eval/NNNN/, OUT/validation/NNNN/, OUT/checkpoints/, OUT/gold_samples.jsonl

Rerun the same command after a crash: finetune goes on from its last checkpoint, evaluate
appends only missing problems, and a matched iteration already in metrics.jsonl is not redone.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from gsm8kctl.artifacts.jsonl import read_jsonl, write_jsonl
from gsm8kctl.artifacts.rundir import (EVAL_METRICS_FILE, FINETUNE_DIR, GOLD_FILE, RUN_METRICS_FILE, SAMPLES_FILE,
                                       STATE_FILE, eval_dir, iteration_dir, latest_checkpoint, load_state)
from gsm8kctl.errors import UserError
from gsm8kctl.progress import say

AT = ("best", "last", "all")


def rl_token_schedule(rl_run: Path) -> tuple[list[dict], dict[int, int]]:
    """The RL run's metrics rows, and the completion tokens it had trained by the end of each
    iteration (its finetune steps, matched to the iteration by their samples' fingerprint)."""
    from gsm8kctl.artifacts.rundir import FINETUNE_METRICS_FILE
    from gsm8kctl.training.trainer import fingerprint

    rows = sorted(read_jsonl(rl_run / RUN_METRICS_FILE), key=lambda r: r["iteration"])
    steps_path = rl_run / FINETUNE_DIR / FINETUNE_METRICS_FILE
    steps = list(read_jsonl(steps_path)) if steps_path.exists() else []
    cumulative, total = {}, 0
    for r in rows:
        samples_path = iteration_dir(rl_run, r["iteration"]) / SAMPLES_FILE
        samples = list(read_jsonl(samples_path)) if samples_path.exists() else []
        if samples:
            fp = fingerprint(samples)
            total += sum(s["completion_tokens"] for s in steps if s.get("phase") == fp)
        cumulative[r["iteration"]] = total
    return rows, cumulative


def check_rl_run(like: Path) -> dict:
    """The RL run's state, once it is known to be a loop's run directory that has evaluated."""
    for name in (RUN_METRICS_FILE, STATE_FILE, "config.yaml"):
        if not (like / name).is_file():
            raise UserError(f"{like}: not a loop's run directory (no {name}); give the --run-dir of a gsm8kctl loop")
    state = load_state(like)
    if not state.get("start_model"):
        raise UserError(f"{like}/{STATE_FILE}: the run has not finished its warm start yet; run the loop first")
    return state


def matched_iterations(rows: list[dict], state: dict, at: str) -> list[int]:
    """The RL run's evaluations the control matches (module docstring)."""
    evaluated = [r["iteration"] for r in rows if r.get("test_accuracy_strict") is not None and r["iteration"] >= 0]
    if not evaluated:
        raise UserError("the RL run has no test evaluation after its warm start yet; run the loop further")
    if at == "all":
        return evaluated
    if at == "last":
        return [evaluated[-1]]
    best = state.get("best") or {}
    return [max(0, best.get("iteration", evaluated[-1]))]  # the starting model's (-1) is the warm start's


def control(cfg: dict, like: str, out: str, *, at: str = "best", quiet: bool = False) -> list[dict]:
    """`cfg` is the RL run's config (its config.yaml, with any overrides); see the module docstring."""
    from gsm8kctl.artifacts.paths import check_output_dir
    from gsm8kctl.config import save_config, set_value
    from gsm8kctl.loop.engine import InProcessEngine

    rl, out_dir = Path(like), Path(out)
    if at not in AT:
        raise UserError(f"--at must be one of {', '.join(AT)}, got {at!r}")
    state = check_rl_run(rl)
    if out_dir.resolve() == rl.resolve():
        raise UserError(f"-o {out}: the control needs a directory of its own, not the RL run's")
    check_output_dir(out_dir, option="-o", files=(RUN_METRICS_FILE, GOLD_FILE), data_dir=cfg["data_dir"])
    from gsm8kctl.artifacts.paths import JSONL_RECORDS, SAVED_CONFIG, check_replaceable
    from gsm8kctl.loop.driver import RUN_METRICS

    check_replaceable(out_dir / RUN_METRICS_FILE, option="-o", kind=RUN_METRICS)
    check_replaceable(out_dir / GOLD_FILE, option="-o", kind=JSONL_RECORDS)
    check_replaceable(out_dir / "config.yaml", option="-o", kind=SAVED_CONFIG)
    rows, cumulative = rl_token_schedule(rl)
    targets = matched_iterations(rows, state, at)
    start = state["start_model"]
    if not Path(start).exists() and Path(start).is_absolute():
        raise UserError(f"{start}: the RL run's warm start is gone (pruned); the control starts from it")
    by_iteration = {r["iteration"]: r for r in rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RUN_METRICS_FILE
    done = {r["iteration"]: r for r in read_jsonl(path)} if path.exists() else {}
    if latest_checkpoint(out_dir) is None:
        set_value(cfg, "model", start)  # where the trainer starts (no checkpoint in OUT yet)
    save_config(cfg, out_dir / "config.yaml")
    engine = InProcessEngine(cfg, out_dir, quiet=True)
    gold = out_dir / GOLD_FILE
    try:
        if not gold.exists():
            # The training split's gold solutions, in the sampler's prompt format, no reference.
            engine.gold_samples(gold, None)
        samples = list(read_jsonl(gold))
        ft = cfg["finetune"]
        per_step = (ft["train_batch_size"] * ft["gradient_accumulation_passes"]
                    * sum(len(s["input_ids"]) - s["prompt_len"] for s in samples) / len(samples))
        for it in targets:
            if it in done:
                continue
            target = cumulative.get(it - 1, 0) if it > 0 else 0  # trained before iteration it's evaluation
            total = math.ceil(target / per_step)
            have = _steps_done(out_dir)
            row: dict = {"iteration": it, "seconds": {}, "train_steps_total": total, "train_tokens_target": target}
            if total > have:
                t0 = time.time()
                engine.finetune(gold, total - have, objective="sft", overrides={"finetune.rl.kl_coef": 0.0})
                engine.wait_saved()  # on disk before it is evaluated: the control resumes from disk alone
                row["seconds"]["finetune"] = round(time.time() - t0, 1)
            model = str(latest_checkpoint(out_dir) or start)
            row["model"] = model
            for split in ("test", "validation") if cfg["validation_problems"] else ("test",):
                if by_iteration[it].get(f"{split}_accuracy_strict") is None:
                    continue  # evaluate where the RL run did
                t0 = time.time()
                limit = cfg["eval_limit"] if split == "test" else None
                engine.evaluate(model, eval_dir(out_dir, it, split), it, limit, split)
                row["seconds"][f"evaluate_{split}"] = round(time.time() - t0, 1)
                m = json.loads((eval_dir(out_dir, it, split) / EVAL_METRICS_FILE).read_text(encoding="utf-8"))
                row.update({f"{split}_accuracy_strict": m["accuracy_strict"],
                            f"{split}_accuracy_lenient": m["accuracy_lenient"], f"{split}_n": m["n"]})
            done[it] = row
            write_jsonl(path, [done[k] for k in sorted(done)])  # atomic: a rerun redoes only what is missing
            rl_test = by_iteration[it].get("test_accuracy_strict")
            say(f"control at iteration {it}: {total} SFT steps ({target} tokens), test strict "
                f"{row.get('test_accuracy_strict', 0):.2%} (RL {rl_test:.2%})", quiet)
    finally:
        engine.close()
    return [done[k] for k in sorted(done)]


def _steps_done(out_dir: Path) -> int:
    from gsm8kctl.artifacts.rundir import checkpoint_step

    ckpt = latest_checkpoint(out_dir)
    return checkpoint_step(ckpt) if ckpt else 0

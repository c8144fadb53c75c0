"""`evaluate`: greedy decoding on the test split; strict and lenient accuracy side by side.

Writes OUT/tapes.jsonl (resumable like `sample`), OUT/metrics.json and OUT/config.yaml.
"""

from __future__ import annotations

import json
from pathlib import Path

from gsm8kctl.artifacts.data import problems_by_id, split_problems
from gsm8kctl.artifacts.jsonl import atomic_write_json, read_jsonl
from gsm8kctl.artifacts.paths import SAVED_CONFIG, OwnFile, check_output_dir, check_replaceable
from gsm8kctl.artifacts.rundir import CONFIG_FILE, EVAL_METRICS_FILE, LLM_CALLS_FILE, TAPES_FILE
from gsm8kctl.config import save_config
from gsm8kctl.errors import UserError
from gsm8kctl.progress import say
from gsm8kctl.sampling.attempts import check_calls_db, existing_output, open_backend, run_attempts
from gsm8kctl.sampling.backends import Backend, SamplingParams
from gsm8kctl.stages.stats import tape_stats


def evaluate(cfg: dict, *, out_dir: str, limit: int | None = None, split: str = "test",
             calls_db: str | None = None, iteration: int = 0, backend: Backend | None = None,
             model_label: str | None = None, quiet: bool = False,
             problem_ids: list[str] | None = None) -> dict:
    # Every check before the model loads and before anything is written: a refused run writes nothing.
    out = Path(out_dir)
    tapes_path = out / TAPES_FILE
    if out_dir == "-":
        raise UserError("-o -: evaluate writes a directory (tapes, metrics.json, config.yaml); give its path, "
                        "and --json for the metrics on stdout")
    check_output_dir(out, option="-o", files=(TAPES_FILE, EVAL_METRICS_FILE, CONFIG_FILE), data_dir=cfg["data_dir"])
    check_replaceable(out / CONFIG_FILE, option="-o", kind=SAVED_CONFIG)
    check_replaceable(out / EVAL_METRICS_FILE, option="-o", kind=EVAL_METRICS)
    calls_db = calls_db or str(out / LLM_CALLS_FILE)
    check_calls_db(calls_db, str(tapes_path), cfg["data_dir"])
    existing = existing_output(str(tapes_path))
    if limit is not None and limit <= 0:
        raise UserError(f"--limit must be a positive number of problems, got {limit}")
    problems = problems_by_id(cfg, split, n_problems=limit, problem_ids=problem_ids)
    if cfg["agent"]["few_shot"] > 0:
        split_problems(cfg, "train")  # the few-shot pool: checked now, cached for later
    params = SamplingParams(n=1, temperature=0.0, top_p=1.0, max_tokens=cfg["evaluation"]["max_tokens"],
                            seed=cfg["seed"])
    own = backend is None
    if own:
        backend = open_backend(cfg)
        say(f"backend: {backend.name}, model: {cfg['model']}", quiet)
    # Only once the inputs checked out: a refused run leaves nothing behind.
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / CONFIG_FILE)
    label = model_label or cfg["model"]
    try:
        run = run_attempts(cfg, backend=backend, problems=problems, attempts=1, params=params,
                           out=str(tapes_path), calls_db=calls_db, iteration=iteration, model_label=label,
                           quiet=quiet, description="evaluating", existing=existing)
    finally:
        if own:
            backend.close()
    metrics = eval_metrics(tapes_path, [p["id"] for p in problems], iteration=iteration, model_label=label,
                           backend=backend.name, split=split, seconds=run["seconds"],
                           tokens_per_s=run["tokens_per_s"])
    atomic_write_json(out / EVAL_METRICS_FILE, metrics)
    return metrics


def _is_eval_metrics(p: Path) -> bool:
    m = json.loads(p.read_text(encoding="utf-8"))
    return isinstance(m, dict) and {"n", "accuracy_strict", "accuracy_lenient"} <= set(m)


EVAL_METRICS = OwnFile(_is_eval_metrics, "evaluate's metrics")  # metrics.json as evaluate writes it


def eval_metrics(tapes_path: Path, problem_ids: list[str], *, iteration: int, model_label: str, backend: str,
                 split: str, seconds: float, tokens_per_s: float) -> dict:
    """metrics.json of an evaluation: the tapes of these problems at this iteration."""
    wanted = set(problem_ids)
    tapes = [t for t in read_jsonl(tapes_path) if t["problem_id"] in wanted and t.get("iteration", 0) == iteration]
    st = tape_stats(tapes)
    return {
        "n": st["count"],
        "accuracy_strict": st["accuracy_strict"],
        "accuracy_lenient": st["accuracy_lenient"],
        "format_rate": st["format_rate"],
        "overflow_rate": st["overflow_rate"],
        "mean_output_tokens": st["tokens"]["completion"]["mean"],
        "model": model_label,
        "backend": backend,
        "split": split,
        "iteration": iteration,
        "seconds": seconds,
        "tokens_per_s": tokens_per_s,
    }

"""`sample`: ask the model `attempts` times per problem; write tapes and the LLM call log.

Resumable: attempts already in the output file are skipped, so rerunning the same command after
a crash appends only what is missing; an attempt redone after a crash replaces its call instead
of adding a second one. The work itself is `gsm8kctl.sampling.attempts` (`run_attempts`), shared with
`evaluate`.
"""

from __future__ import annotations

from pathlib import Path

from gsm8kctl.artifacts.data import problems_by_id, split_problems
from gsm8kctl.artifacts.paths import SAVED_CONFIG, check_output_file, check_replaceable
from gsm8kctl.artifacts.rundir import LLM_CALLS_FILE
from gsm8kctl.config import save_config
from gsm8kctl.progress import say
from gsm8kctl.sampling.attempts import check_calls_db, existing_output, open_backend, run_attempts
from gsm8kctl.sampling.backends import Backend, SamplingParams


def sample(cfg: dict, *, out: str, split: str = "train", n_problems: int | None = None,
           problem_ids: list[str] | None = None, calls_db: str | None = None, iteration: int = 0,
           backend: Backend | None = None, quiet: bool = False, written: list[dict] | None = None) -> dict:
    # Every check before the model loads and before anything is written: a refused run writes nothing.
    if calls_db is None and out != "-":
        calls_db = str(Path(out).parent / LLM_CALLS_FILE)
    config_path = None if out == "-" else Path(out).with_suffix(".config.yaml")
    check_output_file(out, option="-o", data_dir=cfg["data_dir"], append=True)
    if config_path is not None:
        check_output_file(config_path, option="-o (its config)", inputs=[out], data_dir=cfg["data_dir"])
        check_replaceable(config_path, option="-o (its config)", kind=SAVED_CONFIG)
    check_calls_db(calls_db, out, cfg["data_dir"])
    existing = existing_output(out)
    problems = problems_by_id(cfg, split, n_problems=n_problems, problem_ids=problem_ids)
    if cfg["agent"]["few_shot"] > 0:
        split_problems(cfg, "train")  # the few-shot pool: checked now, cached for later
    s = cfg["sampling"]
    params = SamplingParams(n=cfg["attempts"], temperature=s["temperature"], top_p=s["top_p"],
                            max_tokens=s["max_tokens"], seed=cfg["seed"])
    own = backend is None
    if own:
        backend = open_backend(cfg)
        say(f"backend: {backend.name}, model: {cfg['model']}", quiet)
    if config_path is not None:  # only once the inputs checked out: a refused run writes nothing
        save_config(cfg, config_path)
    try:
        return run_attempts(cfg, backend=backend, problems=problems, attempts=cfg["attempts"], params=params,
                            out=out, calls_db=calls_db, iteration=iteration, model_label=cfg["model"],
                            quiet=quiet, existing=existing, written=written)
    finally:
        if own:
            backend.close()

"""`sample`: ask the model `attempts` times per problem; write tapes and the LLM call log.

Resumable: attempts already in the output file are skipped, so rerunning the same command after
a crash appends only what is missing. Calls are written before their tapes in one sqlite
transaction per batch; a tape id is deterministic, so an attempt redone after a crash replaces
its call instead of adding a second one.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from pathlib import Path

from gsm8kctl import agent, llm_calls
from gsm8kctl.backends import Backend, SamplingParams, get_backend, resolve_backend_name
from gsm8kctl.chat import render_prompt
from gsm8kctl.config import save_config
from gsm8kctl.data import load_problems, select_problems
from gsm8kctl.jsonl import JsonlAppender, read_jsonl, truncate_partial_line
from gsm8kctl.models import resolve_model
from gsm8kctl.progress import Progress, say
from gsm8kctl.tapes import LLM_CALLS_FILE, make_tape, tape_id


def done_attempts(out: str, iteration: int) -> set[tuple[str, int]]:
    """(problem_id, attempt) pairs already written to `out` for this iteration."""
    if out == "-" or not Path(out).exists():
        return set()
    truncate_partial_line(out)  # a writer killed mid-line (power loss) leaves a tail to drop
    return {(t["problem_id"], int(t["attempt"])) for t in read_jsonl(out)
            if int(t.get("iteration", 0)) == iteration}


def few_shot_examples(cfg: dict, problem_id: str, k: int, pool: list[dict]) -> list[tuple[str, str]]:
    """K solved train examples, fixed by the seed, never the problem itself."""
    if k <= 0:
        return []
    rng = random.Random(cfg["seed"])
    picks = rng.sample(range(len(pool)), min(len(pool), k + 1))
    chosen = [pool[i] for i in picks if pool[i]["id"] != problem_id][:k]
    return [(p["question"], agent.format_gold_solution(p["solution"])) for p in chosen]


def prompt_for(cfg: dict, tokenizer, problem: dict, pool: list[dict]) -> tuple[list[dict], str, list[int]]:
    a = cfg["agent"]
    messages = agent.build_messages(problem["question"], system_prompt=a["system_prompt"],
                                    task_template=a["task_template"],
                                    few_shot=few_shot_examples(cfg, problem["id"], a["few_shot"], pool))
    text, ids = render_prompt(tokenizer, messages)
    return messages, text, ids


def open_backend(cfg: dict, model: str | None = None) -> Backend:
    name = resolve_backend_name(cfg["backend"])
    target = model or cfg["model"]
    path = target if name == "openai" else resolve_model(target)
    return get_backend(name, path, cfg)


def run_attempts(cfg: dict, *, backend: Backend, problems: list[dict], attempts: int,
                 params: SamplingParams, out: str, calls_db: str | None, iteration: int,
                 model_label: str, quiet: bool = False, description: str = "sampling") -> dict:
    """Sample the missing attempts of `problems`, appending tapes to `out`; returns counts."""
    done = done_attempts(out, iteration)
    missing: dict[str, list[int]] = {}
    for p in problems:
        todo = [a for a in range(attempts) if (p["id"], a) not in done]
        if todo:
            missing[p["id"]] = todo
    skipped = len(problems) * attempts - sum(len(v) for v in missing.values())
    if skipped:
        say(f"{out}: {skipped} attempts already there, sampling the {sum(len(v) for v in missing.values())} missing",
            quiet)
    pool = load_problems("train", cfg["data_dir"]) if cfg["agent"]["few_shot"] > 0 else []
    db = llm_calls.open_log(calls_db) if calls_db else None
    by_id = {p["id"]: p for p in problems}
    # Problems needing the same number of attempts go to the backend together with n = that number.
    buckets: dict[int, list[str]] = defaultdict(list)
    for pid, todo in missing.items():
        buckets[len(todo)].append(pid)
    per_call = max(1, cfg["sampling"]["batch_size"] // max(1, attempts)) if backend.name == "transformers" \
        else max(1, 256 // max(1, attempts))
    stats = {"tapes": 0, "tokens": 0, "skipped": skipped}
    chunk_no = 0
    with JsonlAppender(out) as writer, Progress(len(missing), description, quiet) as bar:
        for n, pids in buckets.items():
            for start in range(0, len(pids), per_call):
                chunk = [by_id[pid] for pid in pids[start:start + per_call]]
                prompts = [prompt_for(cfg, backend.tokenizer, p, pool) for p in chunk]
                seed = None if params.seed is None else params.seed + 1000 * iteration + chunk_no
                chunk_no += 1
                call_params = SamplingParams(n=n, temperature=params.temperature, top_p=params.top_p,
                                             max_tokens=params.max_tokens, seed=seed)
                results = backend.generate([ids for _, _, ids in prompts], call_params)
                tapes, calls, tokens = [], [], 0
                now = time.time()
                for problem, (messages, text, ids), completions in zip(chunk, prompts, results):
                    for attempt, comp in zip(missing[problem["id"]], completions):
                        tid = tape_id(problem["id"], iteration, attempt, model_label)
                        grade = agent.grade(comp.text, problem["gold"], comp.finish_reason,
                                            cfg["agent"]["reward_extractor"])
                        call_id = f"call-{tid}"
                        tapes.append(make_tape(
                            problem=problem, iteration=iteration, attempt=attempt, model=model_label,
                            messages=messages, prompt_token_ids=ids, completion_token_ids=comp.token_ids,
                            logprobs=comp.logprobs, completion_text=comp.text,
                            finish_reason=comp.finish_reason, grade=grade,
                            llm_call_id=call_id if db is not None else None))
                        calls.append(llm_calls.call_record(
                            call_id=call_id, tape_id=tid, backend=backend.name, model=model_label,
                            messages=messages, prompt_text=text, completion=comp.text,
                            params=call_params.as_dict(), prompt_tokens=len(ids),
                            completion_tokens=len(comp.token_ids), latency_s=comp.latency_s,
                            finish_reason=comp.finish_reason, created=now))
                        tokens += len(comp.token_ids)
                if db is not None:
                    llm_calls.insert_calls(db, calls)
                for tape in tapes:
                    writer.write(tape)
                stats["tapes"] += len(tapes)
                stats["tokens"] += tokens
                bar.advance(len(chunk), tokens)
        stats["tokens_per_s"] = round(bar.tokens_per_s, 1)
        stats["seconds"] = round(time.perf_counter() - bar.start, 2)
    if db is not None:
        db.close()
    return stats


def sample(cfg: dict, *, out: str, split: str = "train", n_problems: int | None = None,
           problem_ids: list[str] | None = None, calls_db: str | None = None, iteration: int = 0,
           backend: Backend | None = None, quiet: bool = False) -> dict:
    problems = select_problems(load_problems(split, cfg["data_dir"]), n_problems=n_problems,
                               problem_ids=problem_ids)
    s = cfg["sampling"]
    params = SamplingParams(n=cfg["attempts"], temperature=s["temperature"], top_p=s["top_p"],
                            max_tokens=s["max_tokens"], seed=cfg["seed"])
    if calls_db is None and out != "-":
        calls_db = str(Path(out).parent / LLM_CALLS_FILE)
    own = backend is None
    if own:
        backend = open_backend(cfg)
        say(f"backend: {backend.name}, model: {cfg['model']}", quiet)
    if out != "-":  # only once the inputs checked out: a refused run writes nothing
        save_config(cfg, Path(out).with_suffix(".config.yaml"))
    try:
        return run_attempts(cfg, backend=backend, problems=problems, attempts=cfg["attempts"], params=params,
                            out=out, calls_db=calls_db, iteration=iteration, model_label=cfg["model"],
                            quiet=quiet)
    finally:
        if own:
            backend.close()

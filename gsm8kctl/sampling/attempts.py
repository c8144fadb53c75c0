"""The sampling core shared by the `sample` and `evaluate` stages, `filter --gold` (prompts) and
the loop's in-process engine.

- prompts: the chat messages (system prompt, task template, few-shot examples fixed by the seed)
  rendered once into token ids (`prompt_for`);
- the missing attempts of a tapes file: attempts already in the output are skipped, so rerunning
  the same command after a crash appends only what is missing (`existing_output`,
  `done_attempts`);
- one request per attempt, seeded from (seed, problem, iteration, attempt), so an attempt redone
  after a crash, or run in another run directory, draws the same randomness whatever else shares
  its batch (`run_attempts`);
- the writer thread, which writes calls then tapes: calls are written before their tapes in one
  sqlite transaction per batch; a tape id is deterministic, so an attempt redone after a crash
  replaces its call instead of adding a second one.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gsm8kctl import agent

from gsm8kctl.artifacts import llm_calls
from gsm8kctl.artifacts.chat import render_prompt
from gsm8kctl.artifacts.data import split_problems
from gsm8kctl.artifacts.jsonl import AppendTarget, JsonlAppender, scan_for_append, shown
from gsm8kctl.artifacts.models import resolve_model
from gsm8kctl.artifacts.paths import check_output_file
from gsm8kctl.artifacts.tapes import check_tape, make_tape, tape_id
from gsm8kctl.errors import UserError
from gsm8kctl.progress import Progress, say
from gsm8kctl.sampling.backends import Backend, Completion, SamplingParams, get_backend, resolve_backend_name
from gsm8kctl.sampling.hostgate import HostGate


# Tapes reach the file in groups: at most this many completions (or `sampling.write_interval_s`) apart.
FLUSH_EVERY = 256
REQUESTS_PER_CALL = 256  # backends without streaming (vllm, openai): completions per generate call


def _tape_key(record: dict, where: str) -> tuple[str, int, int]:
    """(problem_id, attempt, iteration) of a tape already in the output; anything else is refused."""
    check_tape(record, where)
    attempt = record.get("attempt")
    if not isinstance(attempt, int) or isinstance(attempt, bool):
        raise UserError(f"{where}: tape {record['id']}: attempt must be an integer, got {shown(attempt)}")
    return record["problem_id"], attempt, record.get("iteration") or 0


def existing_output(out: str) -> AppendTarget | None:
    """The tapes already in `out`, all checked before anything is written (jsonl.scan_for_append)."""
    return None if out == "-" else scan_for_append(out, _tape_key)


def done_attempts(existing: AppendTarget | None, iteration: int) -> set[tuple[str, int]]:
    """(problem_id, attempt) pairs already written for this iteration."""
    if existing is None:
        return set()
    return {(pid, attempt) for pid, attempt, it in existing.keys if it == iteration}


def check_calls_db(calls_db: str | None, out: str, data_dir: str | None) -> None:
    """The call log beside the tapes: writable, not the tapes file itself, a sqlite log of ours."""
    if calls_db is None:
        return
    if out != "-" and Path(calls_db).resolve() == Path(out).resolve():
        raise UserError(f"{out}: the tapes file and --llm-calls are the same file")
    check_output_file(calls_db, option="--llm-calls", inputs=[out], data_dir=data_dir)
    llm_calls.check_log(calls_db)


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


def check_backend_device(cfg: dict, name: str) -> None:
    """What the backend `name` refuses for this machine, said before transformers is imported or a
    model resolved (an embedded model's first use converts it): only torch is imported, to ask it."""
    attention = cfg["transformers"]["decode_attention"]
    if resolve_backend_name(name) != "transformers" or attention not in ("split_k", "flash"):
        return
    import torch

    from gsm8kctl.sampling.backends.base import check_decode_attention

    check_decode_attention(attention, "cuda" if torch.cuda.is_available() else "cpu")  # as transformers.py picks it


def open_backend(cfg: dict, model: str | None = None) -> Backend:
    name = resolve_backend_name(cfg["backend"])
    check_backend_device(cfg, name)
    target = model or cfg["model"]
    path = target if name == "openai" else resolve_model(target)
    return get_backend(name, path, cfg)


def run_attempts(cfg: dict, *, backend: Backend, problems: list[dict], attempts: int,
                 params: SamplingParams, out: str, calls_db: str | None, iteration: int,
                 model_label: str, quiet: bool = False, description: str = "sampling",
                 existing: AppendTarget | None = None, written: list[dict] | None = None) -> dict:
    """Sample the missing attempts of `problems`, appending tapes to `out`; returns counts.

    `existing` is `existing_output(out)`, checked by the caller before it loaded the model.
    `written`, a list, receives every tape appended, in the file's order.
    """
    if existing is None:
        existing = existing_output(out)
    done = done_attempts(existing, iteration)
    missing = {p["id"]: todo for p in problems if (todo := [a for a in range(attempts) if (p["id"], a) not in done])}
    skipped = len(problems) * attempts - sum(len(v) for v in missing.values())
    if skipped:
        say(f"{out}: {skipped} attempts already there, sampling the {sum(len(v) for v in missing.values())} missing",
            quiet)
    pool = split_problems(cfg, "train") if cfg["agent"]["few_shot"] > 0 else []  # never a held-out one
    # The call log is opened, written and closed by the writer thread alone (sqlite
    # connections belong to the thread that made them).
    log: dict = {}

    def calls_log():
        if calls_db and "db" not in log:
            log["db"] = llm_calls.open_log(calls_db)
        return log.get("db")

    by_id = {p["id"]: p for p in problems}
    # One request per missing attempt, seeded by what identifies it: an attempt redone after a crash
    # draws the same randomness whatever else shares its batch (sampling.py says what that buys).
    jobs = _Jobs(cfg=cfg, backend_name=backend.name, params=params, iteration=iteration, model_label=model_label,
                 calls=bool(calls_db), items=[(by_id[pid], attempt) for pid, todo in missing.items() for attempt in todo],
                 rendered={pid: prompt_for(cfg, backend.tokenizer, by_id[pid], pool) for pid in missing})
    stats = {"tapes": 0, "tokens": 0, "skipped": skipped}
    if existing is not None:
        existing.repair()  # our own half-written last line goes, a whole one gets its newline
    gate = HostGate()  # the writer runs while the sampler waits on the GPU (hostgate.py)
    with JsonlAppender(out) as writer, Progress(len(jobs.items), description, quiet, unit="attempts") as bar:
        def flush(pending: list[tuple[int, Completion]]) -> None:
            """Calls first, then tapes: a tape never points at a call that is not there."""
            tapes, calls = jobs.records(pending, gate)
            if calls_db:
                llm_calls.insert_calls(calls_log(), calls)
            for tape in tapes:
                gate.wait()
                writer.write(tape)
            if written is not None:
                written.extend(tapes)
            tokens = sum(len(comp.token_ids) for _, comp in pending)
            stats["tapes"] += len(tapes)
            stats["tokens"] += tokens
            bar.advance(len(pending), tokens)

        with ThreadPoolExecutor(max_workers=1) as writer_thread:
            writes: list = []

            def write(pending: list[tuple[int, Completion]]) -> None:
                writes.append(writer_thread.submit(flush, pending))
                while writes and writes[0].done():
                    writes.pop(0).result()  # a failed write stops sampling now

            try:
                _sample_all(backend, jobs, gate, write, cfg["sampling"]["write_interval_s"])
                for w in writes:
                    w.result()
            finally:
                writer_thread.submit(lambda: log.pop("db").close() if "db" in log else None).result()
        stats["tokens_per_s"] = round(bar.tokens_per_s, 1)
        stats["seconds"] = round(time.perf_counter() - bar.start, 2)
    return stats


@dataclass
class _Jobs:
    """The attempts one `run_attempts` samples: (problem, attempt) in order, each problem's
    rendered prompt, and what makes their tapes and call records."""
    cfg: dict
    backend_name: str
    params: SamplingParams
    iteration: int
    model_label: str
    calls: bool
    items: list[tuple[dict, int]]
    rendered: dict[str, tuple]
    seeds: list[int] | None = field(init=False)

    def __post_init__(self):
        from gsm8kctl.sampling.backends.sampling import completion_seed  # imports torch: not before the input checks

        # From the seed, the problem, the iteration and the attempt only: not the model's path, which
        # after a warm start lies inside the run directory, so one seed samples the same tokens anywhere.
        seed = self.params.seed
        self.seeds = None if seed is None else [completion_seed(seed, p["id"], self.iteration, a)
                                                for p, a in self.items]

    def prompts(self) -> list[list[int]]:
        return [self.rendered[p["id"]][2] for p, _ in self.items]

    def call_params(self, part: range | None = None) -> SamplingParams:
        """One request per attempt (n=1), each with its own seed."""
        p = self.params
        seeds = self.seeds if self.seeds is None or part is None else [self.seeds[k] for k in part]
        return SamplingParams(n=1, temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_tokens, seed=p.seed,
                              seeds=seeds)

    def records(self, pending: list[tuple[int, Completion]], gate: HostGate) -> tuple[list[dict], list[dict]]:
        """The tapes and LLM-call records of finished attempts (by their index in `items`)."""
        tapes, calls = [], []
        now = time.time()
        for k, comp in pending:
            gate.wait()  # while the sampler launches GPU work, this thread keeps off the GIL
            problem, attempt = self.items[k]
            messages, text, ids = self.rendered[problem["id"]]
            tid = tape_id(problem["id"], self.iteration, attempt, self.model_label)
            grade = agent.grade(comp.text, problem["gold"], comp.finish_reason, self.cfg["agent"]["reward_extractor"])
            call_id = f"call-{tid}"
            tapes.append(make_tape(
                problem=problem, iteration=self.iteration, attempt=attempt, model=self.model_label,
                messages=messages, prompt_token_ids=ids, completion_token_ids=comp.token_ids,
                logprobs=comp.logprobs, completion_text=comp.text,
                finish_reason=comp.finish_reason, grade=grade,
                llm_call_id=call_id if self.calls else None))
            call_params = {**self.params.as_dict(), "n": 1, "seed": None if self.seeds is None else self.seeds[k]}
            calls.append(llm_calls.call_record(
                call_id=call_id, tape_id=tid, backend=self.backend_name, model=self.model_label,
                messages=messages, prompt_text=text, completion=comp.text,
                params=call_params, prompt_tokens=len(ids),
                completion_tokens=len(comp.token_ids), latency_s=comp.latency_s,
                finish_reason=comp.finish_reason, created=now))
        return tapes, calls


def _sample_all(backend: Backend, jobs: _Jobs, gate: HostGate, write, every_s: float) -> None:
    """Sample every job, handing finished (index, completion) batches to `write`."""
    prompts = jobs.prompts()
    if hasattr(backend, "generate_iter"):
        # One continuous batch over every attempt; tapes are written as completions finish, by
        # the writer thread (in order), so grading and JSON never stall the GPU; on CUDA the
        # backend lets the writer run only while it waits on the device.
        pending: list[tuple[int, Completion]] = []
        last = time.perf_counter()
        completions = backend.generate_iter(prompts, jobs.call_params(), gate=gate)
        try:
            for k, _, comp in completions:
                pending.append((k, comp))
                if len(pending) >= FLUSH_EVERY or time.perf_counter() - last >= every_s:
                    write(pending)
                    pending, last = [], time.perf_counter()
        finally:
            completions.close()  # opens the gate now, even on an error: the writer must drain
        write(pending)
        return
    for start in range(0, len(prompts), REQUESTS_PER_CALL):
        part = range(start, min(start + REQUESTS_PER_CALL, len(prompts)))
        results = backend.generate([prompts[k] for k in part], jobs.call_params(part))
        write([(k, r[0]) for k, r in zip(part, results)])

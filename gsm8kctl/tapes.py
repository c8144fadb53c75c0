"""The tape: the record of one attempt at one problem (DESIGN.md §3), and its file layout."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from gsm8kctl.agent import Grade

TAPES_FILE = "tapes.jsonl"
SAMPLES_FILE = "samples.jsonl"
METRICS_FILE = "metrics.json"
STATS_FILE = "stats.json"
LLM_CALLS_FILE = "llm_calls.sqlite"

# Keys every tape has; readers of older layouts fill what is missing (see gather_tapes).
TAPE_KEYS = (
    "id", "iteration", "split", "problem_id", "attempt", "model", "question", "gold", "steps",
    "answer", "correct", "reward", "finish_reason", "prompt_token_ids", "completion_token_ids",
    "logprobs", "created",
)


def tape_id(problem_id: str, iteration: int, attempt: int, model: str) -> str:
    """Deterministic id: a rerun of the same attempt replaces, never duplicates, its LLM call."""
    tag = hashlib.sha1(model.encode("utf-8")).hexdigest()[:6]
    return f"{problem_id}-i{iteration:04d}-a{attempt:02d}-{tag}"


def make_tape(
    *, problem: dict, iteration: int, attempt: int, model: str, messages: list[dict],
    prompt_token_ids: list[int], completion_token_ids: list[int], logprobs: list[float] | None,
    completion_text: str, finish_reason: str, grade: Grade, llm_call_id: str | None = None,
) -> dict[str, Any]:
    tid = tape_id(problem["id"], iteration, attempt, model)
    answer_text = grade.strict if grade.strict is not None else grade.lenient
    steps = [
        {"kind": "question", "text": problem["question"]},
        {"kind": "reasoning", "text": completion_text, "llm_call_id": llm_call_id},
        {"kind": "answer", "text": "" if answer_text is None else answer_text},
    ]
    return {
        "id": tid,
        "iteration": iteration,
        "split": problem["split"],
        "problem_id": problem["id"],
        "attempt": attempt,
        "model": model,
        "question": problem["question"],
        "gold": problem["gold"],
        "steps": steps,
        "answer": {
            "strict": grade.strict,
            "lenient": grade.lenient,
            "format": grade.format,
            "correct_strict": grade.correct_strict,
            "correct_lenient": grade.correct_lenient,
            "reason": grade.reason,
        },
        "correct": grade.correct,
        "reward": grade.reward,
        "finish_reason": finish_reason,
        "prompt_token_ids": list(prompt_token_ids),
        "completion_token_ids": list(completion_token_ids),
        "logprobs": None if logprobs is None else [round(float(x), 6) for x in logprobs],
        "n_messages": len(messages),
        "created": round(time.time(), 3),
    }


def outcome(tape: dict) -> str:
    """One word for filters and summaries: correct, wrong, unparsable or overflow."""
    if tape.get("finish_reason") == "length":
        return "overflow"
    if tape.get("correct"):
        return "correct"
    ans = tape.get("answer") or {}
    if ans.get("strict") is None and ans.get("lenient") is None:
        return "unparsable"
    if tape.get("reward", 0) is not None and tape.get("reward", 0) < 0:
        return "unparsable"
    return "wrong"

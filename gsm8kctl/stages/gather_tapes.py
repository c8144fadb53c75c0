"""`gather-tapes`: collect tapes from files and directories into one JSONL file.

Reads, by content rather than by file name:
- this project's tapes, one JSON object per line (`tapes.jsonl`) or as a JSON list / single object;
- TapeAgents tapes (the system users migrate from): a JSON list of
  `{metadata: {id, parent_id, author, result, ...}, context, steps: [{metadata: {id, prompt_id,
  node, agent, other}, kind, ...}]}`, as `examples/rl_gsm8k` wrote them to
  `tapes/<split>/<iteration>/tapes.json` (also JSONL, or YAML documents).

TapeAgents tapes are mapped into the tape schema of `gsm8kctl.artifacts.tapes`: the `task` step gives the
question (and the gold value in its `metadata.other`, a number or a one-element list),
`reasoning_thought*` steps the completion, `answer_action` / `final_answer_action` / a `value` on
the last reasoning step the answer. The completion text is graded by this project's extractors
(`agent.grade`: `answer.strict`, `format`, `lenient`), the agent's own value standing in for a
lenient answer the text does not show; reward and correctness come from `metadata.result` where
present, else from the rule rl_gsm8k used (parse failure -1, answer equal to gold +1, else 0), as
that is what the run trained on. Step kinds we do not know are kept verbatim.

Tapes are deduplicated by id (the first one read wins), so gathering the same run twice, or a run
together with an earlier gathered file, never duplicates a tape.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from rich.markup import escape

from gsm8kctl import agent
from gsm8kctl.artifacts.jsonl import write_jsonl
from gsm8kctl.artifacts.paths import JSONL_RECORDS, check_output_file, check_replaceable, is_inside
from gsm8kctl.artifacts.tapes import TAPE_KEYS
from gsm8kctl.errors import UserError
from gsm8kctl.progress import console, warn as progress_warn

# What a directory walk reads; files named explicitly are read whatever their name.
_WALK_SUFFIXES = (".jsonl", ".json", ".yaml", ".yml")
_YAML_SUFFIXES = (".yaml", ".yml")

# TapeAgents step kinds (examples/gsm8k_tuning and examples/rl_gsm8k).
_TASK_KINDS = {"task"}
_REASONING_KINDS = {"reasoning_thought", "reasoning_thought_with_value"}
_ANSWER_KINDS = {"answer_action", "final_answer_action"}
_FAILURE_KINDS = {"llm_output_parsing_failure_action", "agent_response_parsing_failure_action"}

# rl_gsm8k wrote tapes to .../tapes/<split>/<iteration>/tapes.json; our runs use
# iterations/0003/ and eval/0003/.
_SPLIT_DIRS = {"train": "train", "test": "test", "eval": "test", "iterations": "train"}


@dataclass
class SourceCount:
    source: str
    files: int = 0
    tapes: int = 0
    written: int = 0
    duplicates: int = 0
    skipped: int = 0  # unreadable files
    ignored: int = 0  # readable files without tapes (samples.jsonl, stats.json, config.yaml...)
    layouts: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"source": self.source, "files": self.files, "tapes": self.tapes, "written": self.written,
                "duplicates": self.duplicates, "skipped": self.skipped, "ignored": self.ignored,
                "layouts": dict(self.layouts)}


def gather_tapes(sources: list[str], out: str, *, quiet: bool = False) -> dict:
    """Read every tape under `sources`, write the unique ones to `out` (`-` = stdout).

    Returns `{"out", "written", "duplicates", "sources": [per-source counts], "skipped":
    [{"path", "reason"}], "ignored": [paths]}`. A file that cannot be read is skipped with a
    warning naming it; if no tape at all could be read, nothing is written and UserError is raised.
    """
    _check_sources(sources)
    _check_out(out, sources)
    out_resolved = None if out == "-" else Path(out).resolve()

    def warn(message: str) -> None:
        progress_warn(message, quiet)

    counts = [SourceCount(s) for s in sources]
    skipped: list[dict] = []
    ignored: list[str] = []
    seen: set[str] = set()

    status = console.status("gathering tapes") if not quiet and console.is_terminal else None

    def records() -> Iterator[dict]:
        for count in counts:
            for path, explicit in _files_of(count.source, out_resolved):
                count.files += 1
                if status is not None:
                    status.update(f"gathering tapes: {escape(_shown(path))} ({len(seen)} so far)")
                n_before = count.tapes
                try:
                    for tape, layout in _tapes_in(path, warn):
                        count.tapes += 1
                        count.layouts[layout] += 1
                        if tape["id"] in seen:
                            count.duplicates += 1
                            continue
                        seen.add(tape["id"])
                        count.written += 1
                        yield tape
                except _Unreadable as exc:
                    count.skipped += 1
                    skipped.append({"path": str(path), "reason": str(exc)})
                    warn(f"skipped {_shown(path)}: {exc}")
                    continue
                if count.tapes == n_before:
                    count.ignored += 1
                    ignored.append(str(path))
                    if explicit:  # a file named on the command line is expected to hold tapes
                        warn(f"{_shown(path)}: no tapes in it")

    # Look ahead one record so that nothing (not even an empty file) is written when no tape
    # could be read: the user gets an error and their previous output stays as it was.
    if status is not None:
        status.start()
    try:
        it = records()
        first = next(it, None)
        if first is not None:
            written = write_jsonl(out, _chain(first, it))
    finally:
        if status is not None:
            status.stop()
    if first is None:
        raise UserError(_nothing_found(sources, skipped, ignored))
    result = {
        "out": out,
        "written": written,
        "duplicates": sum(c.duplicates for c in counts),
        "sources": [c.as_dict() for c in counts],
        "skipped": skipped,
        "ignored": ignored,
    }
    if not quiet:
        _report(result)
    return result



def _check_sources(sources: list[str]) -> None:
    if not sources:
        raise UserError("gather-tapes needs at least one source file or directory")
    if sources.count("-") > 1:
        raise UserError("'-' (stdin) can be given only once")
    for s in sources:
        if s != "-" and not Path(s).exists():
            raise UserError(f"{s}: no such file or directory")


def _nothing_found(sources: list[str], skipped: list[dict], ignored: list[str]) -> str:
    detail = []
    if skipped:
        detail.append(f"{len(skipped)} unreadable file(s) skipped")
    if ignored:
        detail.append(f"{len(ignored)} file(s) without tapes")
    more = f" ({', '.join(detail)})" if detail else ""
    return f"no tapes found in {', '.join(sources)}{more}"


def _check_out(out: str, sources: list[str]) -> None:
    """-o must not replace a source: not one of the files, not a file inside a source directory
    (a TapeAgents tapes.json there would be overwritten by its converted copy)."""
    check_output_file(out, option="-o", inputs=[s for s in sources if s != "-" and Path(s).is_file()])
    check_replaceable(out, option="-o", kind=JSONL_RECORDS)
    if out == "-":
        return
    for s in sources:
        if s != "-" and Path(s).is_dir() and is_inside(out, s):
            raise UserError(f"{out}: -o is inside the source directory {s}; write it outside the sources")


def _chain(first: dict, rest: Iterator[dict]) -> Iterator[dict]:
    yield first
    yield from rest


def _shown(path: Path | str) -> str:
    return "<stdin>" if path == "-" else str(path)


def _report(result: dict) -> None:
    from rich.table import Table

    table = Table(title=f"gather-tapes -> {escape(result['out'])}", header_style="bold")
    cols = ("source", "files", "tapes", "written", "duplicates", "skipped", "ignored", "layouts")
    for col in cols:
        table.add_column(col, justify="left" if col in ("source", "layouts") else "right")
    for s in result["sources"]:
        layouts = " ".join(f"{k}:{v}" for k, v in sorted(s["layouts"].items())) or "-"
        table.add_row(escape(s["source"]), *(str(s[c]) for c in cols[1:-1]), layouts)
    console.print(table)
    console.print(f"wrote {result['written']} tapes ({result['duplicates']} duplicates dropped, "
                  f"{len(result['skipped'])} unreadable files skipped)", highlight=False)


# --------------------------------------------------------------------------------------------
# Finding and parsing files


class _Unreadable(Exception):
    """The file cannot be read as JSON / JSONL / YAML at all."""


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of float range")
    return value


def _loads(text: str):
    """JSON without NaN/Infinity: a tape with one is unreadable, like any other bad line."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


_NOT_JSON = object()


def _files_of(source: str, out_resolved: Path | None) -> Iterator[tuple[Path | str, bool]]:
    """Files of one source, in a stable order; (path, named explicitly)."""
    if source == "-":
        yield "-", True
        return
    p = Path(source)
    if p.is_file():
        yield p, True
        return
    for f in sorted(p.rglob("*")):
        rel = f.relative_to(p).parts
        # Hidden files and dirs include the temp files of atomic writers (.tapes.jsonl.x.tmp).
        if any(part.startswith(".") for part in rel) or not f.is_file():
            continue
        if f.suffix.lower() not in _WALK_SUFFIXES:
            continue
        if out_resolved is not None and f.resolve() == out_resolved:
            continue  # our own previous output inside a source directory
        yield f, False


def _open_binary(path: Path | str) -> BinaryIO:
    if path == "-":
        return sys.stdin.buffer
    try:
        return open(path, "rb")
    except OSError as exc:
        raise _Unreadable(exc.strerror or str(exc)) from None


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Unreadable(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _records(path: Path | str, warn: Callable[[str], None]) -> Iterator[Any]:
    """JSON values in a file: JSONL lines (streamed), a JSON document, or YAML documents.

    Whether the file is readable is decided before the first value is yielded, so a caller
    never gets part of an unreadable file.
    """
    suffix = "" if path == "-" else Path(path).suffix.lower()
    f = _open_binary(path)
    try:
        if suffix in _YAML_SUFFIXES:
            import yaml

            try:
                docs = list(yaml.safe_load_all(_decode(f.read())))
            except yaml.YAMLError as exc:
                raise _Unreadable(f"invalid YAML ({str(exc).splitlines()[0]})") from None
            for doc in docs:
                yield from (doc if isinstance(doc, list) else [doc])
            return
        first = b""
        lineno = 0
        for raw in f:
            lineno += 1
            if raw.strip():
                first = raw
                break
        if not first:
            return  # empty file
        try:
            value = _loads(_decode(first))
        except ValueError:
            value = _NOT_JSON
        if value is _NOT_JSON or first.lstrip().startswith(b"["):
            # One JSON document over many lines (a list of tapes, a pretty-printed tape).
            try:
                whole = _loads(_decode(first + f.read()))
            except json.JSONDecodeError as exc:
                raise _Unreadable(f"not JSON or JSONL (line {exc.lineno + lineno - 1}: {exc.msg})") from None
            except ValueError as exc:
                raise _Unreadable(f"not JSON or JSONL ({exc})") from None
            yield from (whole if isinstance(whole, list) else [whole])
            return
        # JSONL, streamed: a bad line (a writer killed mid-line) loses that line, not the file.
        yield value
        bad, first_bad = 0, ""
        for raw in f:
            lineno += 1
            if not raw.strip():
                continue
            try:
                yield _loads(raw.decode("utf-8"))
            except ValueError as exc:  # JSON, UTF-8 or a non-finite number
                bad += 1
                reason = getattr(exc, "msg", None) or getattr(exc, "reason", None) or str(exc)
                first_bad = first_bad or f"line {lineno}: {reason}"
        if bad:
            warn(f"{path}: skipped {bad} invalid line(s), first at {first_bad}")
    finally:
        if f is not sys.stdin.buffer:
            f.close()


def _tapes_in(path: Path | str, warn: Callable[[str], None]) -> Iterator[tuple[dict, str]]:
    """(tape in our schema, layout name) for every tape in one file."""
    hint = _path_hint(path)
    attempts: Counter = Counter()
    for value in _records(path, warn):
        if _is_tapeagents(value):
            yield _from_tapeagents(value, hint, attempts), "tapeagents"
        elif _is_ours(value):
            yield _from_ours(value, hint), "gsm8kctl"


# --------------------------------------------------------------------------------------------
# Our own tapes (any earlier layout: missing keys are filled, nothing is dropped)


def _is_ours(v: Any) -> bool:
    # Training samples (input_ids, labels) and metrics lines are not tapes.
    return (isinstance(v, dict) and isinstance(v.get("id"), (str, int)) and not isinstance(v.get("id"), bool)
            and ("question" in v or isinstance(v.get("steps"), list))
            and "input_ids" not in v and not isinstance(v.get("metadata"), dict))


def _from_ours(v: dict, hint: dict) -> dict:
    tape = {k: v.get(k) for k in TAPE_KEYS}
    tape["id"] = str(v["id"])
    steps = v.get("steps") or []
    if tape["question"] is None:
        tape["question"] = next((s.get("text") for s in steps
                                 if isinstance(s, dict) and s.get("kind") == "question"), None)
    if tape["iteration"] is None:
        tape["iteration"] = hint.get("iteration", 0)
    if tape["split"] is None:
        tape["split"] = hint.get("split", "unknown")
    if tape["steps"] is None:
        tape["steps"] = []
    if tape["answer"] is None:
        tape["answer"] = {}
    if tape["reward"] is None:
        tape["reward"] = 1.0 if v.get("correct") else 0.0
    if tape["correct"] is None:
        tape["correct"] = bool(tape["reward"] and tape["reward"] > 0)
    # Extra keys of the record (n_messages, anything newer) travel along after the schema keys.
    for k, val in v.items():
        if k not in tape:
            tape[k] = val
    return tape


# --------------------------------------------------------------------------------------------
# TapeAgents tapes


def _is_tapeagents(v: Any) -> bool:
    return (isinstance(v, dict) and isinstance(v.get("metadata"), dict)
            and isinstance(v.get("steps"), list)
            and all(isinstance(s, dict) and "kind" in s for s in v["steps"]))


def _path_hint(path: Path | str) -> dict:
    """Iteration and split from a file's place: .../tapes/train/3/tapes.json, iterations/0003/."""
    if path == "-":
        return {}
    parts = Path(path).parts
    hint: dict = {}
    for i in range(len(parts) - 2, 0, -1):
        if parts[i].isdigit() and parts[i - 1] in _SPLIT_DIRS:
            hint = {"iteration": int(parts[i]), "split": _SPLIT_DIRS[parts[i - 1]]}
            break
    return hint


def _num_text(value: Any) -> str | None:
    """A TapeAgents answer value (72, 72.0, "1,234", [72]) as our answer text ("72", "1234")."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]  # some datasets store the gold as [value]
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str):
        value = value.strip().replace(",", "")
        try:
            value = float(value)
        except ValueError:
            return value or None
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if float(value).is_integer():
            return str(int(value))
        return repr(float(value))
    return None


def _same_number(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    try:
        x, y = float(a), float(b)
    except ValueError:
        return a == b
    return abs(x - y) <= 1e-9 * max(1.0, abs(y))


_GOLD_RE = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)


def _gold_of(other: dict, result: dict) -> str | None:
    for src in (other, result):
        if "value" in src:
            gold = _num_text(src["value"])
            if gold is not None:
                return gold
    for src in (other, result):
        found = _GOLD_RE.findall(str(src.get("answer", "")))
        if found:
            return _num_text(found[-1])
    return None


def _reward_from_result(result: Any) -> tuple[float | None, bool | None]:
    """(reward, correct) as recorded in a tape's `metadata.result`, where it says."""
    if isinstance(result, bool):
        return (1.0 if result else 0.0), result
    if isinstance(result, (int, float)) and math.isfinite(result):
        return float(result), result > 0
    if not isinstance(result, dict):
        return None, None
    reward = result.get("reward")
    reward = float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else None
    correct = None
    for key in ("correct", "solved", "success"):
        if isinstance(result.get(key), (bool, int)):
            correct = bool(result[key])
            break
    if reward is None and correct is not None:
        reward = 1.0 if correct else 0.0
    if correct is None and reward is not None:
        correct = reward > 0
    return reward, correct


@dataclass
class _TapeAgentsSteps:
    """What a TapeAgents tape's steps say: the question, the answer's value, whether parsing
    failed, the steps in our schema and the completion text to grade."""
    question: str | None = None
    other: dict = field(default_factory=dict)
    value: Any = None
    parse_failed: bool = False
    steps: list[dict] = field(default_factory=list)
    completion_parts: list[str] = field(default_factory=list)


def _read_tapeagents_steps(raw_steps: list[dict]) -> _TapeAgentsSteps:
    out = _TapeAgentsSteps()
    for s in raw_steps:
        kind = s.get("kind")
        smeta = s.get("metadata") if isinstance(s.get("metadata"), dict) else {}
        if kind in _TASK_KINDS and out.question is None:
            out.question = str(s.get("task", ""))
            out.other = smeta.get("other") if isinstance(smeta.get("other"), dict) else {}
            out.steps.append({"kind": "question", "text": out.question})
        elif kind in _REASONING_KINDS:
            text = str(s.get("reasoning", ""))
            out.completion_parts.append(text)
            out.steps.append({"kind": "reasoning", "text": text, "llm_call_id": smeta.get("prompt_id") or None})
            if "value" in s:
                out.value = s["value"]
        elif kind in _ANSWER_KINDS:
            out.value = s.get("value", s.get("text"))
            out.steps.append({"kind": "answer", "text": _num_text(out.value) or str(s.get("text", ""))})
            if s.get("text") is not None:
                out.completion_parts.append(str(s["text"]))  # "Natalia sold 72 clips." is graded too
        else:
            if kind in _FAILURE_KINDS:
                out.parse_failed = True
            out.steps.append(s)  # unknown kinds verbatim
    return out


def _from_tapeagents(v: dict, hint: dict, attempts: Counter) -> dict:
    meta = v["metadata"]
    result = meta.get("result")
    result_dict = result if isinstance(result, dict) else {}
    read = _read_tapeagents_steps(v["steps"])
    question, other, value, parse_failed = read.question, read.other, read.value, read.parse_failed
    steps, completion_parts = read.steps, read.completion_parts
    if question is None:
        question = str(result_dict.get("question", "")) or None
    gold = _gold_of(other, result_dict)
    answer = _num_text(value)
    overflow = "no_overflow" in result_dict and not result_dict["no_overflow"]
    graded = agent.grade("\n".join(completion_parts), gold or "")  # its extractions, not reward
    lenient = graded.lenient if graded.lenient is not None else answer
    reward, correct = _reward_from_result(result)
    if reward is None:
        # The rule examples/rl_gsm8k applied: a parse failure is -1, the right value +1.
        if parse_failed:
            reward, correct = -1.0, False
        else:
            correct = _same_number(answer, gold)
            reward = 1.0 if correct else 0.0
    if parse_failed:
        reason = "TapeAgents: the agent's output could not be parsed"
    elif answer is None:
        reason = "TapeAgents: no answer value"
    else:
        reason = f"TapeAgents: answer {answer} vs gold {gold}"

    # Attempts at one problem share the problem's question; the problem id is stable across
    # iterations and files (TapeAgents' parent_id changes with every iteration).
    if question:
        problem_id = "q-" + hashlib.sha1(question.encode("utf-8")).hexdigest()[:12]
    else:
        problem_id = str(meta.get("parent_id") or meta.get("id"))
    attempt = attempts[problem_id]
    attempts[problem_id] += 1
    tape_id = meta.get("id") or "ta-" + hashlib.sha1(
        json.dumps(v, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]
    tape = {
        "id": str(tape_id),
        "iteration": hint.get("iteration", result_dict.get("iteration", 0)),
        "split": hint.get("split", result_dict.get("split", "unknown")),
        "problem_id": problem_id,
        "attempt": attempt,
        "model": meta.get("author"),
        "question": question,
        "gold": gold,
        "steps": steps,
        "answer": {
            "strict": graded.strict,
            "lenient": lenient,
            "format": graded.format,
            "correct_strict": graded.correct_strict,
            "correct_lenient": agent.answers_match(lenient, gold or ""),
            "reason": reason,
        },
        "correct": bool(correct),
        "reward": reward,
        "finish_reason": "length" if overflow else None,
        "prompt_token_ids": None,
        "completion_token_ids": None,
        "logprobs": None,
        "created": None,
        "source": {"format": "tapeagents", "metadata": meta, "context": v.get("context")},
    }
    return tape

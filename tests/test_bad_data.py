"""Bad data, refused where it is read: one table of malformed inputs across the commands.

Every row runs the real CLI (tests/badinput.py) and asserts exit 2, one stderr line naming the
file:line (or path) and the key, no traceback, no pre-existing file changed and nothing left
behind. Each bad tape sits next to a healthy sibling, so a run that skipped or patched the bad
line instead of refusing it would still fail here (it would write samples for the sibling).
Checks run before any model loads: a row costs the CLI's start-up, not a model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from badinput import Case, run_case, valid_tape

# --------------------------------------------------------------------------------------------
# Inputs: a valid tape, sample and GSM8k row; `raw` values are written verbatim (NaN, 1e999)


def tape(i: int = 0, **over) -> dict:
    return valid_tape(i, rewarded=(i == 0), **over)


def sample(i: int = 0, **over) -> dict:
    s = {"id": f"s{i}", "tape_id": f"s{i}", "problem_id": "train-00000", "group_id": "i0000/train-00000",
         "iteration": 0, "model": "m", "input_ids": [1, 2, 3, 4, 5], "prompt_len": 3,
         "old_logprobs": [-0.1, -0.2], "ref_logprobs": None, "kl": None, "reward": 1.0,
         "advantage": 0.5, "weight": 0.5}
    s.update(over)
    return s


def row(i: int = 0, **over) -> dict:
    r = {"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
    r.update(over)
    return r


class raw(str):
    """A value written into the JSON line as is: NaN, -Infinity, 1e999."""


def line(record) -> str:
    """One JSONL line; `raw` values (also inside lists) replace their placeholders verbatim."""
    found: list[str] = []

    def mark(v):
        if isinstance(v, raw):
            found.append(str(v))
            return f"@@RAW{len(found) - 1}@@"
        if isinstance(v, list):
            return [mark(x) for x in v]
        if isinstance(v, dict):
            return {k: mark(x) for k, x in v.items()}
        return v

    text = json.dumps(mark(record))
    for n, value in enumerate(found):
        text = text.replace(f'"@@RAW{n}@@"', value)
    return text


def files(contents: dict):
    """setup(tmp) writing {relative path: [records or str lines] | bytes}."""

    def setup(tmp: Path) -> None:
        for name, body in contents.items():
            p = tmp / name
            p.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(body, bytes):
                p.write_bytes(body)
            else:
                p.write_text("".join((x if isinstance(x, str) else line(x)) + "\n" for x in body))
    return setup


def data(train):
    """setup(tmp) of a GSM8k directory tmp/data: this train.jsonl and a good test.jsonl."""
    return files({"data/train.jsonl": train, "data/test.jsonl": GOOD_ROWS})


def with_bad_utf8_at_line_3(records: list) -> bytes:
    """Three lines (the third holds a byte that is not UTF-8), then more lines after it."""
    text = [line(r).encode() for r in records]
    text[2] = text[2][:-1] + b', "note": "caf\xe9"}'  # Latin-1, not UTF-8
    return b"\n".join(text) + b"\n"


TAPES = "{tmp}/t.jsonl"
SAMPLES = "{tmp}/s.jsonl"
OUT = "{tmp}/out.jsonl"
OLD_OUT = [{"note": "previous samples, kept as they are"}]  # a pre-existing output: must stay unchanged
SAMPLE_CMD = ["sample", "-o", "{tmp}/tapes.jsonl", "--data-dir", "{tmp}/data", "--model", "{tiny}",
              "--backend", "transformers", "--n-problems", "2", "-q"]
FINETUNE = ["finetune", SAMPLES, "-o", "{tmp}/run", "--init", "{tiny}", "-q"]
GOOD_ROWS = [row(0), row(1), row(2)]

CASES = [
    # --- stats: tapes ------------------------------------------------------------------------
    Case("stats-nan-reward", ["stats", "--json", TAPES], "t.jsonl:2: reward is not a finite number",
         files({"t.jsonl": [tape(0), tape(1, reward=raw("NaN"))]})),
    Case("stats-infinity-logprob", ["stats", TAPES], "t.jsonl:2: logprobs[1] is not a finite number",
         files({"t.jsonl": [tape(0), tape(1, logprobs=[-0.1, raw("-Infinity")])]})),
    Case("stats-overflowing-reward", ["stats", "--json", TAPES], "t.jsonl:2: reward is not a finite",
         files({"t.jsonl": [tape(0), tape(1, reward=raw("1e999"))]})),
    Case("stats-string-reward", ["stats", TAPES], "t.jsonl:2: reward must be a finite number",
         files({"t.jsonl": [tape(0), tape(1, reward="high")]})),
    Case("stats-foreign-object", ["stats", TAPES], "t.jsonl:1: not a tape (missing id, problem_id, reward)",
         files({"t.jsonl": [{"foo": 1}, tape(0)]})),
    Case("stats-tape-without-reward", ["stats", TAPES], "t.jsonl:2: not a tape (missing reward)",
         files({"t.jsonl": [tape(0), {k: v for k, v in tape(1).items() if k != "reward"}]})),
    Case("stats-null-id", ["stats", TAPES], "t.jsonl:2: id must be a non-empty string, got null",
         files({"t.jsonl": [tape(0), tape(1, id=None)]})),
    Case("stats-list-line", ["stats", TAPES], "t.jsonl:2: expected a JSON object, got list",
         files({"t.jsonl": [tape(0), "[1, 2, 3]"]})),
    Case("stats-token-ids-not-a-list", ["stats", TAPES], "t.jsonl:2: completion_token_ids must be a list",
         files({"t.jsonl": [tape(0), tape(1, completion_token_ids="4 5")]})),
    Case("stats-answer-not-an-object", ["stats", TAPES], "t.jsonl:2: answer must be an object",
         files({"t.jsonl": [tape(0), tape(1, answer=["5"])]})),
    Case("stats-sample-among-tapes", ["stats", TAPES], "t.jsonl:2: this is a training sample",
         files({"t.jsonl": [tape(0), sample(0)]})),
    Case("stats-invalid-utf8-line-3", ["stats", TAPES], "t.jsonl:3: not a text JSONL file",
         files({"t.jsonl": with_bad_utf8_at_line_3([tape(0), tape(1), tape(2), tape(3)])})),
    Case("stats-empty-file", ["stats", TAPES], "t.jsonl: no records", files({"t.jsonl": ["", "  "]})),
    Case("stats-stdin-nan", ["stats", "--json", "-"], "<stdin>:1: reward is not a finite number",
         stdin=line(tape(0, reward=raw("NaN"))).replace("{", "{{").replace("}", "}}") + "\n"),  # formatted
    # --- stats: samples ----------------------------------------------------------------------
    Case("stats-sample-without-prompt-len", ["stats", SAMPLES],
         "s.jsonl:2: not a training sample (missing prompt_len)",
         files({"s.jsonl": [sample(0), {k: v for k, v in sample(1).items() if k != "prompt_len"}]})),
    Case("stats-sample-string-weight", ["stats", "--json", SAMPLES], "s.jsonl:2: weight must be a finite number",
         files({"s.jsonl": [sample(0), sample(1, weight="0.5")]})),
    Case("stats-tape-among-samples", ["stats", SAMPLES], "s.jsonl:2: this is a tape",
         files({"s.jsonl": [sample(0), tape(0)]})),
    Case("stats-sample-nan-advantage", ["stats", SAMPLES], "s.jsonl:1: advantage is not a finite number",
         files({"s.jsonl": [sample(0, advantage=raw("NaN")), sample(1)]})),
    # --- filter --------------------------------------------------------------------------------
    Case("filter-nan-reward-keeps-old-output", ["filter", TAPES, "-o", OUT, "--mode", "all"],
         "t.jsonl:2: reward is not a finite number",
         files({"t.jsonl": [tape(0), tape(1, reward=raw("NaN"))], "out.jsonl": OLD_OUT})),
    Case("filter-nan-logprob", ["filter", TAPES, "-o", OUT, "--mode", "all"],
         "t.jsonl:2: logprobs[0] is not a finite number",
         files({"t.jsonl": [tape(0), tape(1, logprobs=[raw("NaN"), -0.2])]})),
    Case("filter-infinity-reward-stdout", ["filter", TAPES, "-o", "-"], "t.jsonl:1: reward is not a finite",
         files({"t.jsonl": [tape(0, reward=raw("Infinity")), tape(1)]})),
    Case("filter-string-reward", ["filter", TAPES, "-o", OUT], "t.jsonl:2: reward must be a finite number",
         files({"t.jsonl": [tape(0), tape(1, reward="1")]})),
    Case("filter-missing-completion", ["filter", TAPES, "-o", OUT],
         "t.jsonl:2: not a tape (missing completion_token_ids)",
         files({"t.jsonl": [tape(0), {k: v for k, v in tape(1).items() if k != "completion_token_ids"}]})),
    Case("filter-null-prompt-ids", ["filter", TAPES, "-o", OUT], "t.jsonl:2: prompt_token_ids must be a list",
         files({"t.jsonl": [tape(0), tape(1, prompt_token_ids=None)]})),
    Case("filter-bool-token-id", ["filter", TAPES, "-o", OUT], "t.jsonl:2: completion_token_ids must be a list",
         files({"t.jsonl": [tape(0), tape(1, completion_token_ids=[4, True])]})),
    Case("filter-string-logprob", ["filter", TAPES, "-o", OUT], "t.jsonl:2: logprobs must hold",
         files({"t.jsonl": [tape(0), tape(1, logprobs=[-0.1, "-0.2"])]})),
    Case("filter-logprobs-wrong-length", ["filter", TAPES, "-o", OUT], "t.jsonl:2: logprobs must hold",
         files({"t.jsonl": [tape(0), tape(1, logprobs=[-0.1])]})),
    Case("filter-string-iteration", ["filter", TAPES, "-o", OUT], "t.jsonl:2: iteration must be an integer",
         files({"t.jsonl": [tape(0), tape(1, iteration="0")]})),
    Case("filter-samples-given", ["filter", SAMPLES, "-o", OUT], "s.jsonl:1: this is a training sample",
         files({"s.jsonl": [sample(0)]})),
    Case("filter-invalid-utf8-line-3", ["filter", TAPES, "-o", OUT], "t.jsonl:3: not a text JSONL file",
         files({"t.jsonl": with_bad_utf8_at_line_3([tape(0), tape(1), tape(2), tape(3)])})),
    Case("filter-gold-non-numeric", ["filter", "--gold", "--data-dir", "{tmp}/data", "--model", "{tiny}",
                                     "-o", OUT, "-q"],
         "train.jsonl:2: answer: the gold after '####' must be a number, got \"seventy-two\"",
         data([row(0), row(1, answer="48 + 24\n#### seventy-two"), row(2)])),
    # --- finetune ------------------------------------------------------------------------------
    Case("finetune-nan-weight", FINETUNE, "s.jsonl:2: weight is not a finite number",
         files({"s.jsonl": [sample(0), sample(1, weight=raw("NaN"))]})),
    Case("finetune-infinity-old-logprob", FINETUNE, "s.jsonl:1: old_logprobs[1] is not a finite number",
         files({"s.jsonl": [sample(0, old_logprobs=[-0.1, raw("-Infinity")])]})),
    Case("finetune-bool-ref-logprob", FINETUNE, "s.jsonl:2: ref_logprobs must hold 2 numbers",
         files({"s.jsonl": [sample(0), sample(1, ref_logprobs=[-0.1, False])]})),
    Case("finetune-string-reward", FINETUNE, "s.jsonl:2: reward must be a finite number",
         files({"s.jsonl": [sample(0), sample(1, reward="1.0")]})),
    Case("finetune-without-prompt-len", FINETUNE, "s.jsonl:1: not a training sample (missing prompt_len)",
         files({"s.jsonl": [{k: v for k, v in sample(0).items() if k != "prompt_len"}]})),
    Case("finetune-null-id", FINETUNE, "s.jsonl:1: id must be a non-empty string, got null",
         files({"s.jsonl": [sample(0, id=None)]})),
    Case("finetune-tapes-given", FINETUNE, "s.jsonl:1: this is a tape, not a training sample",
         files({"s.jsonl": [tape(0)]})),
    Case("finetune-invalid-utf8-line-3", FINETUNE, "s.jsonl:3: not a text JSONL file",
         files({"s.jsonl": with_bad_utf8_at_line_3([sample(0), sample(1), sample(2), sample(3)])})),
    Case("finetune-empty-file", FINETUNE, "no training samples in", files({"s.jsonl": ["\n"]})),
    # --- sample: a bad GSM8k data directory ----------------------------------------------------
    Case("sample-non-numeric-gold", SAMPLE_CMD, "train.jsonl:2: answer: the gold after '####' must be a number",
         data([row(0), row(1, answer="#### seventy-two"), row(2)])),
    Case("sample-empty-gold", SAMPLE_CMD, "train.jsonl:1: answer: the gold after '####' must be a number",
         data([row(0, answer="no idea\n####"), row(1)])),
    Case("sample-missing-answer", SAMPLE_CMD, "train.jsonl:2: expected an object with 'question' and 'answer'",
         data([row(0), {"question": "q"}])),
    Case("sample-numeric-answer", SAMPLE_CMD, "train.jsonl:1: answer must be a non-empty string, got 72",
         data([row(0, answer=72)])),
    Case("sample-invalid-utf8-line-3", SAMPLE_CMD, "train.jsonl:3: not a text JSONL file",
         data(with_bad_utf8_at_line_3([row(0), row(1), row(2), row(3)]))),
    Case("sample-list-line", SAMPLE_CMD, "train.jsonl:2: expected a JSON object, got list",
         data([row(0), '["q", "a"]'])),
    Case("sample-empty-data-file", SAMPLE_CMD, "train.jsonl: no problems in it",
         data([""])),
    Case("sample-nan-in-data", SAMPLE_CMD, "train.jsonl:2: difficulty is not a finite number",
         data([row(0), row(1, difficulty=raw("NaN"))])),
    # --- gather-tapes ----------------------------------------------------------------------------
    Case("gather-foreign-objects-only", ["gather-tapes", "{tmp}/foo.jsonl", "-o", OUT, "-q"],
         "no tapes found in", files({"foo.jsonl": [{"foo": 1}, {"bar": [1]}], "out.jsonl": OLD_OUT})),
    Case("gather-binary-file", ["gather-tapes", "{tmp}/calls.sqlite", "-o", OUT, "-q"],
         "1 unreadable file(s) skipped", files({"calls.sqlite": b"SQLite format 3\x00\xff\xfe\x00\x81"})),
    Case("gather-samples-dir", ["gather-tapes", "{tmp}/run", "-o", OUT], "1 file(s) without tapes",
         files({"run/samples.jsonl": [sample(0), sample(1)]})),
    Case("gather-missing-source", ["gather-tapes", "{tmp}/nope", "-o", OUT], "nope: no such file or directory"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_data_is_refused(case, tmp_path, request):
    run_case(case, tmp_path, request)


def test_the_table_is_wide():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 30
    assert {c.args[0] for c in CASES} >= {"stats", "filter", "finetune", "sample", "gather-tapes"}

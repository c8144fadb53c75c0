"""Bad paths and files, refused before anything is written: one table across the commands.

Every row runs the real CLI (tests/badinput.py) and asserts exit 2, one stderr line naming the
path (or file:line, or option), no traceback, no pre-existing file changed and nothing left
behind. The rows cover outputs that would destroy an input or a GSM8k data file, existing
outputs that are not our tapes (sample/evaluate append to them), unwritable or impossible output
paths, broken call logs and loop state, unknown offline models, typed options and browse's
host/port. The checks run before any model loads, so a row costs the CLI's start-up only.

Read-only directories: tests run as root, whom chmod 555 does not stop. Those rows run the CLI
as user 65534 (`setpriv`) with only CAP_DAC_READ_SEARCH, so it can read the venv, the model and
the data wherever they are, but writes only where the mode bits let that user write, which is
exactly what a read-only directory means. A control row shows the same user can write next door.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import badinput
from badinput import Case, check_refused, valid_tape
from conftest import GSM8K_DIR, REPO

# --------------------------------------------------------------------------------------------
# Inputs


def tape(i: int = 0, **over) -> dict:
    return valid_tape(i, **over)


def sample(i: int = 0) -> dict:
    return {"id": f"s{i}", "tape_id": f"s{i}", "problem_id": "train-00000", "group_id": "i0000/train-00000",
            "iteration": 0, "model": "m", "input_ids": [1, 2, 3, 4, 5], "prompt_len": 3,
            "old_logprobs": [-0.1, -0.2], "ref_logprobs": None, "kl": None, "reward": 1.0,
            "advantage": 0.5, "weight": 0.5}


def our_line(record: dict) -> str:
    """A line exactly as our writer writes it (gsm8kctl.artifacts.jsonl.dumps)."""
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))


TAPES = "".join(our_line(tape(i)) + "\n" for i in range(2))
SAMPLES = "".join(our_line(sample(i)) + "\n" for i in range(2))
TAPEAGENTS = json.dumps([{"metadata": {"id": "ta-1", "result": {"reward": 1}},
                          "context": None,
                          "steps": [{"metadata": {}, "kind": "task", "task": "2 + 3?"},
                                    {"metadata": {}, "kind": "answer_action", "text": "5", "value": 5}]}])


def _data_rows(split: str, n: int = 3) -> str:
    with open(GSM8K_DIR / f"{split}.jsonl", encoding="utf-8") as f:
        return "".join(next(f) for _ in range(n))


def _sqlite_log(path: Path, rows: int = 400) -> None:
    """A real call log of ours, big enough to span many pages."""
    from gsm8kctl.artifacts import llm_calls

    db = llm_calls.open_log(path)
    llm_calls.insert_calls(db, [llm_calls.call_record(
        call_id=f"c{i}", tape_id=f"t{i}", backend="b", model="m", messages=[], prompt_text="p" * 300,
        completion="c" * 300, params={}, prompt_tokens=1, completion_tokens=1, latency_s=0.1,
        finish_reason="stop", created=float(i)) for i in range(rows)])
    db.close()


def _path(name: str) -> str:
    """A keyword as a path: `__` is `/`, the last `_` is the dot (run__state_json = run/state.json)."""
    *dirs, last = name.split("__")
    stem, _, ext = last.rpartition("_")
    return "/".join([*dirs, f"{stem}.{ext}"])


def files(**spec):
    """setup(tmp) writing files: keyword path (see _path) -> str | bytes | callable(path)."""

    def setup(tmp: Path) -> None:
        for name, content in spec.items():
            p = tmp / _path(name)
            p.parent.mkdir(parents=True, exist_ok=True)
            if callable(content):
                content(p)
            elif isinstance(content, bytes):
                p.write_bytes(content)
            else:
                p.write_text(content, encoding="utf-8")

    return setup


def both(*setups):
    def setup(tmp: Path) -> None:
        for s in setups:
            s(tmp)

    return setup


def data_dir(train: str | None = None, test: str | None = None):
    """A small GSM8k directory at tmp/data (real rows unless given)."""
    return files(data__train_jsonl=train if train is not None else _data_rows("train"),
                 data__test_jsonl=test if test is not None else _data_rows("test"))


def mkdirs(*names):
    def setup(tmp: Path) -> None:
        for n in names:
            (tmp / n).mkdir(parents=True, exist_ok=True)

    return setup


def symlink(name: str, target: str):
    return lambda tmp: (tmp / name).symlink_to(tmp / target)


def hardlink(name: str, target: str):
    return lambda tmp: os.link(tmp / target, tmp / name)


def truncated_log(p: Path) -> None:
    _sqlite_log(p)
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)


def foreign_db(p: Path) -> None:
    conn = sqlite3.connect(p)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.commit()
    conn.close()


def zeroed_header(p: Path) -> None:
    _sqlite_log(p, rows=10)
    with open(p, "r+b") as f:
        f.write(b"\0" * 100)


def state(obj) -> str:
    return json.dumps(obj)


GOOD_STATE = {"iteration": 1, "phase": "sample", "cursor": 4, "problems": None, "child_pgid": None,
              "timings": {}, "best": None}
DATA = ["--data-dir", "{tmp}/data"]
SAVED_CONFIG = "model: m\nsampling: {}\nfinetune: {}\n"  # the main sections of a config a stage saved
T = "{tmp}/tapes.jsonl"
# A port someone else is listening on, for browse: held for the whole test session.
_BUSY = socket.socket()
_BUSY.bind(("127.0.0.1", 0))
_BUSY.listen(1)
BUSY_PORT = str(_BUSY.getsockname()[1])

# --------------------------------------------------------------------------------------------
# An output that is one of the inputs, or a GSM8k data file

CLOBBER = [
    Case("filter-o-is-the-input", ["filter", T, "-o", T], "is the input file", files(tapes_jsonl=TAPES)),
    Case("filter-mode-all-o-is-the-input", ["filter", T, "--mode", "all", "-o", T], "is the input file",
         files(tapes_jsonl=TAPES)),
    Case("filter-o-is-a-hard-link-of-the-input", ["filter", T, "-o", "{tmp}/hard.jsonl"], "{tmp}/hard.jsonl",
         both(files(tapes_jsonl=TAPES), hardlink("hard.jsonl", "tapes.jsonl"))),
    Case("filter-o-is-a-symlink-to-the-input", ["filter", T, "-o", "{tmp}/link.jsonl"], "is the input file",
         both(files(tapes_jsonl=TAPES), symlink("link.jsonl", "tapes.jsonl"))),
    Case("filter-o-is-the-input-by-another-path", ["filter", T, "-o", "{tmp}/sub/../tapes.jsonl"],
         "is the input file", both(files(tapes_jsonl=TAPES), mkdirs("sub"))),
    Case("filter-o-is-the-second-input", ["filter", T, "{tmp}/b.jsonl", "-o", "{tmp}/b.jsonl"],
         "is the input file {tmp}/b.jsonl", files(tapes_jsonl=TAPES, b_jsonl=TAPES)),
    Case("filter-o-is-a-data-file", ["filter", T, "-o", "{tmp}/data/train.jsonl", *DATA], "GSM8k data file",
         both(files(tapes_jsonl=TAPES), data_dir())),
    Case("filter-gold-o-is-the-train-file", ["filter", "--gold", "-o", "{tmp}/data/train.jsonl", *DATA],
         "{tmp}/data/train.jsonl", data_dir()),
    Case("filter-o-symlink-to-data-file", ["filter", T, "-o", "{tmp}/l.jsonl", *DATA], "GSM8k data file",
         both(files(tapes_jsonl=TAPES), data_dir(), symlink("l.jsonl", "data/test.jsonl"))),
    Case("sample-o-is-the-train-file", ["sample", "-o", "{tmp}/data/train.jsonl", "--model", "{tiny}", *DATA],
         "GSM8k data file", data_dir()),
    Case("sample-llm-calls-is-the-tapes-file", ["sample", "-o", T, "--llm-calls", T, "--model", "{tiny}"],
         "the tapes file and --llm-calls are the same file", files(tapes_jsonl=TAPES)),
    Case("sample-o-is-the-call-log", ["sample", "-o", "{tmp}/llm_calls.sqlite", "--model", "{tiny}"],
         "same file", files(llm_calls_sqlite=_sqlite_log)),
    Case("evaluate-llm-calls-is-the-test-file", ["evaluate", "-o", "{tmp}/ev", "--llm-calls",
                                                 "{tmp}/data/test.jsonl", "--model", "{tiny}", *DATA],
         "GSM8k data file", data_dir()),
    Case("finetune-out-is-the-samples-file", ["finetune", "{tmp}/s.jsonl", "--out", "{tmp}/s.jsonl"],
         "is the input samples file", files(s_jsonl=SAMPLES)),
    Case("finetune-out-is-a-symlink-to-the-samples", ["finetune", "{tmp}/s.jsonl", "--out", "{tmp}/run"],
         "is the input samples file", both(files(s_jsonl=SAMPLES), symlink("run", "s.jsonl"))),
    Case("finetune-samples-inside-out-checkpoints", ["finetune", "{tmp}/run/checkpoints/s.jsonl", "--out",
                                                     "{tmp}/run"], "{tmp}/run/checkpoints/s.jsonl",
         files(run__checkpoints__s_jsonl=SAMPLES)),
    Case("finetune-samples-inside-out-finetune-dir", ["finetune", "{tmp}/run/finetune/metrics.jsonl", "--out",
                                                      "{tmp}/run"], "which finetune rewrites",
         files(run__finetune__metrics_jsonl=SAMPLES)),
    Case("gather-o-is-the-input", ["gather-tapes", T, "-o", T], "is the input file", files(tapes_jsonl=TAPES)),
    Case("gather-o-is-a-hard-link-of-an-input", ["gather-tapes", T, "{tmp}/t.json", "-o", "{tmp}/h.json"],
         "is the input file {tmp}/t.json",
         both(files(tapes_jsonl=TAPES, t_json=TAPEAGENTS), hardlink("h.json", "t.json"))),
    Case("gather-o-inside-a-source-dir", ["gather-tapes", "{tmp}/src", "-o", "{tmp}/src/all.jsonl"],
         "inside the source directory {tmp}/src", files(src__tapes_jsonl=TAPES)),
    Case("gather-o-replaces-a-tapeagents-file", ["gather-tapes", "{tmp}/src", "-o", "{tmp}/src/old/tapes.json"],
         "{tmp}/src/old/tapes.json", files(src__old__tapes_json=TAPEAGENTS, src__tapes_jsonl=TAPES)),
]

# --------------------------------------------------------------------------------------------
# sample/evaluate append to -o; an existing file that is not our tapes is refused whole

FRAGMENT = our_line(tape(1))[:60]  # what a writer of ours leaves when it dies mid-line
APPEND = [
    Case("sample-o-text-file-without-final-newline", ["sample", "-o", "{tmp}/notes.txt", "--model", "{tiny}"],
         "{tmp}/notes.txt:1", files(notes_txt="line one\nline two")),
    Case("sample-o-foreign-json", ["sample", "-o", "{tmp}/x.jsonl", "--model", "{tiny}"], "{tmp}/x.jsonl:1",
         files(x_jsonl='{"name": "not a tape"}\n')),
    Case("sample-o-foreign-json-list", ["sample", "-o", "{tmp}/x.json", "--model", "{tiny}"], "{tmp}/x.json:1",
         files(x_json=TAPEAGENTS)),
    Case("sample-o-tapes-then-foreign-last-line", ["sample", "-o", T, "--model", "{tiny}"], "{tmp}/tapes.jsonl:3",
         files(tapes_jsonl=TAPES + '{"name": "x"}')),
    Case("sample-o-tapes-then-text-last-line", ["sample", "-o", T, "--model", "{tiny}"], "{tmp}/tapes.jsonl:3",
         files(tapes_jsonl=TAPES + "a note")),
    Case("sample-o-tapes-then-foreign-fragment", ["sample", "-o", T, "--model", "{tiny}"], "{tmp}/tapes.jsonl:3",
         files(tapes_jsonl=TAPES + '{"name": "x", "va')),
    Case("sample-o-bad-middle-line", ["sample", "-o", T, "--model", "{tiny}"], "{tmp}/tapes.jsonl:2",
         files(tapes_jsonl=our_line(tape(0)) + "\nnot json\n" + our_line(tape(1)) + "\n")),
    Case("sample-o-binary-file", ["sample", "-o", "{tmp}/blob.bin", "--model", "{tiny}"], "{tmp}/blob.bin:1",
         files(blob_bin=b"\x00\xff\xfe binary\n\x89PNG")),
    Case("sample-o-samples-file", ["sample", "-o", "{tmp}/s.jsonl", "--model", "{tiny}"], "{tmp}/s.jsonl:1",
         files(s_jsonl=SAMPLES)),
    Case("sample-o-tape-with-string-attempt", ["sample", "-o", T, "--model", "{tiny}"], "attempt",
         files(tapes_jsonl=our_line(tape(0, attempt="x")) + "\n")),
    # Our own half-written last line is dropped only by a run that goes ahead: a refused run keeps it.
    Case("sample-own-fragment-kept-by-a-refused-run", ["sample", "-o", T, "--problem-ids", "train-99999",
                                                       "--model", "{tiny}"], "train-99999",
         files(tapes_jsonl=TAPES + FRAGMENT)),
    Case("evaluate-existing-tapes-is-a-text-file", ["evaluate", "-o", "{tmp}/ev", "--model", "{tiny}"],
         "{tmp}/ev/tapes.jsonl:1", files(ev__tapes_jsonl="my notes\nmore")),
    Case("evaluate-existing-tapes-foreign-last-line", ["evaluate", "-o", "{tmp}/ev", "--model", "{tiny}"],
         "{tmp}/ev/tapes.jsonl:3", files(ev__tapes_jsonl=TAPES + "[1, 2, 3]")),
]

# --------------------------------------------------------------------------------------------
# Outputs replaced whole (filter, gather-tapes, a stage's config and metrics): a file there that no
# stage wrote is refused, not replaced (a rerun replacing its own output is in the stages' tests)

REPLACE = [
    Case("filter-o-replaces-a-text-file", ["filter", T, "-o", "{tmp}/notes.txt"], "{tmp}/notes.txt: -o would replace",
         files(tapes_jsonl=TAPES, notes_txt="my notes\n")),
    Case("gather-o-replaces-a-text-file", ["gather-tapes", T, "-o", "{tmp}/notes.txt"], "{tmp}/notes.txt: -o would",
         files(tapes_jsonl=TAPES, notes_txt="my notes\n")),
    Case("gather-o-replaces-a-json-list", ["gather-tapes", T, "-o", "{tmp}/l.json"], "not a JSONL file",
         files(tapes_jsonl=TAPES, l_json="[1, 2]\n")),
    Case("sample-config-beside-o-is-the-users", ["sample", "-o", T, "--model", "{tiny}"], "{tmp}/tapes.config.yaml",
         lambda tmp: (tmp / "tapes.config.yaml").write_text("my: settings\n")),
    Case("evaluate-o-dir-holds-a-foreign-metrics-json", ["evaluate", "-o", "{tmp}/ev", "--model", "{tiny}"],
         "{tmp}/ev/metrics.json", files(ev__metrics_json='{"mine": 1}\n')),
    Case("evaluate-o-dir-holds-a-foreign-config-yaml", ["evaluate", "-o", "{tmp}/ev", "--model", "{tiny}"],
         "{tmp}/ev/config.yaml", files(ev__config_yaml="x: 1\n")),
    Case("loop-run-dir-holds-a-foreign-metrics-jsonl", ["loop", "--run-dir", "{tmp}/run", "--model", "{tiny}"],
         "{tmp}/run/metrics.jsonl", files(run__metrics_jsonl='{"step": 1}\n')),
    Case("loop-run-dir-holds-a-foreign-config-yaml", ["loop", "--run-dir", "{tmp}/run", "--model", "{tiny}"],
         "{tmp}/run/config.yaml", files(run__config_yaml="- a list\n")),
    Case("evaluate-o-is-stdout", ["evaluate", "-o", "-", "--model", "{tiny}"], "-o -: evaluate writes a directory"),
]

# --------------------------------------------------------------------------------------------
# Impossible output paths, broken call logs and state, unknown offline models

PATHS = [
    # the parent of the output is a file
    Case("filter-o-parent-is-a-file", ["filter", T, "-o", "{tmp}/f.txt/s.jsonl"], "{tmp}/f.txt is not a directory",
         files(tapes_jsonl=TAPES, f_txt="x\n")),
    Case("sample-o-parent-is-a-file", ["sample", "-o", "{tmp}/f.txt/t.jsonl", "--model", "{tiny}"],
         "{tmp}/f.txt is not a directory", files(f_txt="x\n")),
    Case("evaluate-o-parent-is-a-file", ["evaluate", "-o", "{tmp}/f.txt/ev", "--model", "{tiny}"],
         "{tmp}/f.txt is not a directory", files(f_txt="x\n")),
    Case("finetune-out-parent-is-a-file", ["finetune", "{tmp}/s.jsonl", "--out", "{tmp}/f.txt/run"],
         "{tmp}/f.txt is not a directory", files(s_jsonl=SAMPLES, f_txt="x\n")),
    Case("gather-o-parent-is-a-file", ["gather-tapes", T, "-o", "{tmp}/f.txt/all.jsonl"],
         "{tmp}/f.txt is not a directory", files(tapes_jsonl=TAPES, f_txt="x\n")),
    Case("loop-run-dir-parent-is-a-file", ["loop", "--run-dir", "{tmp}/f.txt/run", "--model", "{tiny}"],
         "{tmp}/f.txt is not a directory", files(f_txt="x\n")),
    Case("sample-llm-calls-parent-is-a-file", ["sample", "-o", T, "--llm-calls", "{tmp}/f.txt/c.sqlite",
                                               "--model", "{tiny}"], "{tmp}/f.txt is not a directory",
         files(f_txt="x\n")),
    # -o is a directory (or --run-dir / evaluate -o / finetune --out a file)
    Case("filter-o-is-a-directory", ["filter", T, "-o", "{tmp}/d"], "{tmp}/d: -o is a directory",
         both(files(tapes_jsonl=TAPES), mkdirs("d"))),
    Case("sample-o-is-a-directory", ["sample", "-o", "{tmp}/d", "--model", "{tiny}"], "{tmp}/d: -o is a directory",
         mkdirs("d")),
    Case("gather-o-is-a-directory", ["gather-tapes", T, "-o", "{tmp}/d"], "{tmp}/d: -o is a directory",
         both(files(tapes_jsonl=TAPES), mkdirs("d"))),
    Case("sample-llm-calls-is-a-directory", ["sample", "-o", T, "--llm-calls", "{tmp}/d", "--model", "{tiny}"],
         "{tmp}/d", mkdirs("d")),
    Case("evaluate-metrics-json-is-a-directory", ["evaluate", "-o", "{tmp}/ev", "--model", "{tiny}"],
         "{tmp}/ev/metrics.json: is a directory", mkdirs("ev/metrics.json")),
    Case("loop-run-dir-is-a-file", ["loop", "--run-dir", "{tmp}/f.txt", "--model", "{tiny}"],
         "{tmp}/f.txt: --run-dir exists and is not a directory", files(f_txt="x\n")),
    Case("evaluate-o-is-a-file", ["evaluate", "-o", "{tmp}/f.txt", "--model", "{tiny}"],
         "{tmp}/f.txt: -o exists and is not a directory", files(f_txt="x\n")),
    Case("finetune-out-is-a-file", ["finetune", "{tmp}/s.jsonl", "--out", "{tmp}/f.txt"],
         "{tmp}/f.txt: --out exists and is not a directory", files(s_jsonl=SAMPLES, f_txt="x\n")),
    # a corrupt, truncated or foreign call log: named, before the model loads
    Case("sample-call-log-is-text", ["sample", "-o", T, "--model", "{tiny}"], "{tmp}/llm_calls.sqlite",
         files(llm_calls_sqlite="this is not a database\n")),
    Case("sample-call-log-truncated", ["sample", "-o", T, "--llm-calls", "{tmp}/c.sqlite", "--model", "{tiny}"],
         "{tmp}/c.sqlite: truncated", files(c_sqlite=truncated_log)),
    Case("sample-call-log-is-jsonl", ["sample", "-o", T, "--llm-calls", "{tmp}/c.jsonl", "--model", "{tiny}"],
         "{tmp}/c.jsonl: not an SQLite database", files(c_jsonl=TAPES)),
    Case("evaluate-call-log-zeroed-header", ["evaluate", "-o", "{tmp}/ev", "--model", "{tiny}"],
         "{tmp}/ev/llm_calls.sqlite", files(ev__llm_calls_sqlite=zeroed_header)),
    Case("evaluate-call-log-foreign-db", ["evaluate", "-o", "{tmp}/ev", "--llm-calls", "{tmp}/app.db",
                                          "--model", "{tiny}"], "{tmp}/app.db", files(app_db=foreign_db)),
    Case("loop-call-log-truncated", ["loop", "--run-dir", "{tmp}/run", "--model", "{tiny}"],
         "{tmp}/run/llm_calls.sqlite: truncated", files(run__llm_calls_sqlite=truncated_log)),
    # the loop's state.json with the wrong schema: no config.yaml, no .lock written
    Case("loop-state-is-a-list", ["loop", "--run-dir", "{tmp}/run", "--model", "{tiny}"],
         "{tmp}/run/state.json", files(run__state_json="[]")),
    Case("loop-state-bad-phase", ["loop", "--run-dir", "{tmp}/run", "--model", "{tiny}"], "'phase'",
         files(run__state_json=state({**GOOD_STATE, "phase": "bogus"}))),
    Case("loop-state-iteration-is-a-string", ["loop", "--run-dir", "{tmp}/run", "--model", "{tiny}"], "'iteration'",
         files(run__state_json=state({**GOOD_STATE, "iteration": "3"}))),
    Case("loop-state-problems-not-a-list", ["loop", "--run-dir", "{tmp}/run", "--model", "{tiny}"], "'problems'",
         files(run__state_json=state({**GOOD_STATE, "problems": 5}), run__config_yaml=SAVED_CONFIG)),
    Case("loop-state-without-start-model-for-ref-start", ["loop", "--run-dir", "{tmp}/run", "--model", "{tiny}",
                                                          "filter.ref_model=start", "finetune.rl.kl_coef=0.1"],
         "{tmp}/run/state.json: filter.ref_model=start", files(run__state_json=state(GOOD_STATE),
                                                              run__config_yaml=SAVED_CONFIG)),
    # a hub id that is not in the cache while offline (HF_HUB_OFFLINE=1 in conftest)
    Case("sample-unknown-hub-model-offline", ["sample", "-o", T, "--model", "nosuch-org/nosuch-model"],
         "nosuch-org/nosuch-model"),
    Case("evaluate-unknown-hub-model-offline", ["evaluate", "-o", "{tmp}/ev", "--model", "nosuch-org/nosuch-model"],
         "nosuch-org/nosuch-model"),
    Case("finetune-unknown-hub-init-offline", ["finetune", "{tmp}/s.jsonl", "--out", "{tmp}/run", "--init",
                                               "nosuch-org/nosuch-model"], "nosuch-org/nosuch-model",
         files(s_jsonl=SAMPLES)),
    Case("loop-unknown-hub-model-offline", ["loop", "--run-dir", "{tmp}/run", "--model", "nosuch-org/nosuch-model"],
         "nosuch-org/nosuch-model"),
    Case("filter-unknown-hub-ref-model-offline", ["filter", T, "-o", "{tmp}/s.jsonl", "--ref-model",
                                                  "nosuch-org/nosuch-model"], "nosuch-org/nosuch-model",
         files(tapes_jsonl=TAPES)),
    # `start` names a loop's starting model: outside the loop it is refused, not taken for a path
    # The config's `start` (the default) means the loop's warm start, and none in a filter alone;
    # naming it as the model to score with is a mistake.
    Case("filter-ref-model-start-outside-the-loop", ["filter", T, "-o", "{tmp}/s.jsonl", "--ref-model", "start"],
         "filter.ref_model 'start'", files(tapes_jsonl=TAPES)),
    # refused runs write no config: sample's <out>.config.yaml, loop's config.yaml
    Case("sample-refused-writes-no-config", ["sample", "-o", T, "--problem-ids", "train-99999", "--model", "{tiny}"],
         "train-99999"),
    Case("loop-refused-keeps-config", ["loop", "--run-dir", "{tmp}/run", "--model", "{tiny}", *DATA],
         "{tmp}/data/train.jsonl", both(data_dir(train=""), files(run__config_yaml=SAVED_CONFIG))),
    # the validation split, the seeds and control commands
    Case("loop-validation-holds-out-everything", ["loop", "--run-dir", "{tmp}/run", "--model", "{tiny}",
                                                  "validation_problems=99999"], "validation_problems=99999"),
    Case("evaluate-unknown-split", ["evaluate", "--split", "dev", "-o", "{tmp}/ev", "--model", "{tiny}"],
         "unknown split 'dev'"),
    Case("seeds-not-integers", ["seeds", "--seeds", "1,x", "--run-dir", "{tmp}/s"], "--seeds"),
    Case("seeds-repeated", ["seeds", "--seeds", "1,1", "--run-dir", "{tmp}/s"], "give distinct seeds"),
    Case("seeds-parallel-zero", ["seeds", "--seeds", "1", "--parallel", "0", "--run-dir", "{tmp}/s"], "--parallel"),
    Case("seeds-foreign-summary", ["seeds", "--seeds", "1", "--run-dir", "{tmp}/s"], "{tmp}/s/seeds.json",
         files(s__seeds_json='{"mine": 1}')),
    Case("control-like-not-a-run", ["control", "{tmp}", "-o", "{tmp}/c"], "not a loop's run directory"),
]

# --------------------------------------------------------------------------------------------
# Typed options: one line, not click's usage box; browse checks host and port before indexing

OPTIONS = [
    Case("sample-attempts-not-an-integer", ["sample", "-o", T, "--attempts", "abc"],
         "--attempts: 'abc' is not a valid integer"),
    Case("sample-temperature-not-a-number", ["sample", "-o", T, "--temperature", "hot"],
         "--temperature: 'hot' is not a valid number"),
    Case("evaluate-limit-not-an-integer", ["evaluate", "-o", "{tmp}/ev", "--limit", "2.5"],
         "--limit: '2.5' is not a valid integer"),
    Case("loop-iterations-not-an-integer", ["loop", "--run-dir", "{tmp}/run", "--iterations", "many"],
         "--iterations: 'many' is not a valid integer"),
    Case("finetune-steps-not-an-integer", ["finetune", "{tmp}/s.jsonl", "--out", "{tmp}/run", "--steps", "x"],
         "--steps: 'x' is not a valid integer", files(s_jsonl=SAMPLES)),
    Case("filter-max-per-problem-not-an-integer", ["filter", T, "--max-per-problem", "two"],
         "--max-per-problem: 'two' is not a valid integer", files(tapes_jsonl=TAPES)),
    Case("browse-port-not-an-integer", ["browse", T, "--port", "http"], "--port: 'http' is not a valid integer",
         files(tapes_jsonl=TAPES)),
    Case("sample-iteration-negative", ["sample", "-o", T, "--iteration", "-5"], "--iteration"),
    Case("sample-problem-ids-without-an-id", ["sample", "-o", T, "--problem-ids", ",", "--model", "{tiny}"],
         "--problem-ids: no problem id"),
    Case("sample-problem-ids-and-n-problems", ["sample", "-o", T, "--problem-ids", "train-00001", "--n-problems",
                                               "3", "--model", "{tiny}"], "--problem-ids and --n-problems"),
    Case("evaluate-problem-ids-and-limit", ["evaluate", "-o", "{tmp}/ev", "--problem-ids", "test-00001", "--limit",
                                            "3", "--model", "{tiny}"], "--problem-ids and --limit"),
    Case("sample-misspelt-option", ["sample", "-o", T, "--atempts", "3"], "No such option: --atempts"),
    Case("sample-missing-out", ["sample", "--attempts", "3"], "Missing option '--out'"),
    Case("browse-port-out-of-range", ["browse", T, "--port", "99999"], "--port 99999", files(tapes_jsonl=TAPES)),
    Case("browse-port-busy", ["browse", T, "--port", BUSY_PORT], f"127.0.0.1:{BUSY_PORT}", files(tapes_jsonl=TAPES)),
    # Not an address of this machine: refused at bind, before indexing and before the warning
    # that a non-loopback host would print.
    Case("browse-host-not-local", ["browse", T, "--host", "203.0.113.7", "--port", "0"], "203.0.113.7",
         files(tapes_jsonl=TAPES)),
]

# --------------------------------------------------------------------------------------------
# Messages name what the user gave; stats of bad paths

MESSAGES = [
    Case("evaluate-limit-zero-names-limit", ["evaluate", "-o", "{tmp}/ev", "--limit", "0", "--model", "{tiny}"],
         "--limit"),
    Case("sample-empty-train-file-named", ["sample", "-o", T, "--model", "{tiny}", *DATA],
         "{tmp}/data/train.jsonl", data_dir(train="")),
    Case("evaluate-empty-test-file-named", ["evaluate", "-o", "{tmp}/ev", "--model", "{tiny}", *DATA],
         "{tmp}/data/test.jsonl", data_dir(test="\n\n")),
    Case("filter-gold-empty-train-file-named", ["filter", "--gold", "-o", "{tmp}/g.jsonl", *DATA],
         "{tmp}/data/train.jsonl", data_dir(train="")),
    Case("stats-directory", ["stats", "{tmp}/d"], "{tmp}/d: is a directory", mkdirs("d")),
    Case("stats-empty-file", ["stats", "{tmp}/e.jsonl"], "{tmp}/e.jsonl: no records", files(e_jsonl="")),
    Case("stats-binary-file", ["stats", "{tmp}/b.bin"], "{tmp}/b.bin:1", files(b_bin=b"\xff\xfe\x00\x01\n")),
    Case("stats-empty-stdin", ["stats", "-"], "no records", stdin=""),
]

# --------------------------------------------------------------------------------------------
# A local model directory with a broken file: named before any backend loads it (transformers,
# vLLM and our decoder each failed deep inside with an internal error)

M = "{tmp}/model"
GOOD_CONFIG = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64})


def safetensors_bytes(declared_bytes: int, data: bytes) -> bytes:
    """A safetensors file whose one tensor claims `declared_bytes` of data; `data` follows the header."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [declared_bytes // 4],
                               "data_offsets": [0, declared_bytes]}}).encode()
    return len(header).to_bytes(8, "little") + header + data


def model_dir(**broken):
    """setup(tmp): a model directory at tmp/model with a config, a tokenizer and weights (empty:
    the checks read headers only), then `broken` files written over or added (see files)."""
    return both(files(model__config_json=GOOD_CONFIG, model__tokenizer_json="{}",
                      model__model_safetensors=safetensors_bytes(16, b"\0" * 16)),
                files(**{f"model__{k}": v for k, v in broken.items()}))


BROKEN_MODELS = [
    Case("evaluate-model-config-not-json", ["evaluate", "-o", "{tmp}/ev", "--model", M],
         "{tmp}/model/config.json:1: invalid JSON", files(model__config_json='{"model_type": "llama",')),
    Case("sample-model-config-is-a-list", ["sample", "-o", T, "--model", M],
         "{tmp}/model/config.json: expected a JSON object", files(model__config_json="[]")),
    Case("sample-model-size-is-a-string", ["sample", "-o", T, "--model", M],
         "{tmp}/model/config.json: hidden_size must be a positive integer",
         files(model__config_json='{"model_type": "llama", "hidden_size": "big"}')),
    Case("evaluate-model-layers-zero", ["evaluate", "-o", "{tmp}/ev", "--model", M], "num_hidden_layers",
         files(model__config_json='{"model_type": "llama", "num_hidden_layers": 0}')),
    Case("evaluate-model-tokenizer-json-truncated", ["evaluate", "-o", "{tmp}/ev", "--model", M],
         "{tmp}/model/tokenizer.json:1: invalid JSON",
         model_dir(tokenizer_json='{"version": "1.0", "trunc')),
    Case("sample-model-chat-template-does-not-compile", ["sample", "-o", T, "--model", M],
         "{tmp}/model/chat_template.jinja:2: the chat template does not compile",
         model_dir(chat_template_jinja="{% for m in messages %}\n{{ m.content ")),
    Case("evaluate-model-template-in-tokenizer-config", ["evaluate", "-o", "{tmp}/ev", "--model", M],
         "{tmp}/model/tokenizer_config.json: the chat template does not compile",
         model_dir(tokenizer_config_json='{"chat_template": "{% if %}"}')),
    Case("finetune-init-safetensors-not-one", ["finetune", "{tmp}/s.jsonl", "--out", "{tmp}/run", "--init", M],
         "{tmp}/model/model.safetensors: not a safetensors file",
         both(files(s_jsonl=SAMPLES), model_dir(model_safetensors=b"\0" * 100))),
    Case("loop-model-safetensors-cut-short", ["loop", "--run-dir", "{tmp}/run", "--model", M],
         "{tmp}/model/model.safetensors: cut short",
         model_dir(model_safetensors=safetensors_bytes(64, b"\0" * 16))),
    Case("filter-ref-model-index-not-json", ["filter", T, "-o", "{tmp}/s.jsonl", "--ref-model", M],
         "{tmp}/model/model.safetensors.index.json:1",
         both(files(tapes_jsonl=TAPES), model_dir(),
              lambda tmp: (tmp / "model" / "model.safetensors.index.json").write_text("{"))),
    Case("evaluate-model-without-tokenizer", ["evaluate", "-o", "{tmp}/ev", "--model", M],
         "{tmp}/model: no tokenizer files", both(model_dir(), lambda tmp: (tmp / "model" / "tokenizer.json").unlink())),
    Case("sample-model-without-weights", ["sample", "-o", T, "--model", M], "{tmp}/model: no weights",
         both(model_dir(), lambda tmp: (tmp / "model" / "model.safetensors").unlink())),
    # a model_type transformers does not know: its paragraph (vLLM's validation error) as one line
    Case("evaluate-model-type-unknown", ["evaluate", "-o", "{tmp}/ev", "--model", M],
         "{tmp}/model/config.json: transformers", model_dir(config_json='{"model_type": "foobar"}')),
    Case("finetune-init-model-type-unknown", ["finetune", "{tmp}/s.jsonl", "--out", "{tmp}/run", "--init", M],
         "{tmp}/model/config.json: transformers",
         both(files(s_jsonl=SAMPLES), model_dir(config_json='{"model_type": "foobar", "vocab_size": 100}'))),
    Case("loop-model-index-names-a-missing-shard", ["loop", "--run-dir", "{tmp}/run", "--model", M],
         "shard model-00002-of-00002.safetensors is missing",
         both(model_dir(), lambda tmp: (tmp / "model" / "model.safetensors.index.json").write_text(json.dumps(
             {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})))),
]

TABLE = CLOBBER + APPEND + REPLACE + PATHS + OPTIONS + MESSAGES + BROKEN_MODELS


@pytest.mark.parametrize("case", TABLE, ids=str)
def test_bad_input_is_refused(case, tmp_path, tiny_model_dir):
    check_refused(case, tmp_path, tiny_model_dir)


def test_table_is_large_and_ids_unique():
    assert len(TABLE) + len(READ_ONLY) >= 60
    ids = [c.id for c in TABLE + READ_ONLY]
    assert len(ids) == len(set(ids))


# --------------------------------------------------------------------------------------------
# Read-only directories, as an unprivileged user (root writes through chmod 555)

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
          "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
RO = "{tmp}/ro"


def _as_nobody(*args, input=None, timeout=600, env=None, check=False):
    full_env = {**os.environ, **(env or {}), "HOME": tempfile.gettempdir()}
    return subprocess.run([*NOBODY, sys.executable, "-m", "gsm8kctl", *args], input=input, capture_output=True,
                          text=True, timeout=timeout, env=full_env, cwd=str(REPO))


def read_only(*setups):
    """The case's files, then tmp/ro: a directory user 65534 cannot write (root-owned, 555)."""

    def setup(tmp: Path) -> None:
        for s in setups:
            s(tmp)
        (tmp / "ro").mkdir(exist_ok=True)
        for p in [tmp, *tmp.rglob("*")]:
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o777)
        (tmp / "ro").chmod(0o555)

    return setup


READ_ONLY = [
    Case("ro-filter-o", ["filter", T, "-o", f"{RO}/s.jsonl"], "{tmp}/ro is not writable",
         read_only(files(tapes_jsonl=TAPES))),
    Case("ro-sample-o", ["sample", "-o", f"{RO}/t.jsonl", "--model", "{tiny}"], "{tmp}/ro is not writable",
         read_only()),
    Case("ro-sample-existing-tapes-not-writable", ["sample", "-o", T, "--model", "{tiny}"],
         "{tmp}/tapes.jsonl: -o is not writable", read_only(files(tapes_jsonl=TAPES))),
    Case("ro-sample-llm-calls", ["sample", "-o", T, "--llm-calls", f"{RO}/c.sqlite", "--model", "{tiny}"],
         "{tmp}/ro is not writable", read_only()),
    Case("ro-evaluate-o", ["evaluate", "-o", f"{RO}/ev", "--model", "{tiny}"], "{tmp}/ro is not writable",
         read_only()),
    Case("ro-evaluate-o-is-the-ro-dir", ["evaluate", "-o", RO, "--model", "{tiny}"], "{tmp}/ro: -o is not writable",
         read_only()),
    Case("ro-finetune-out", ["finetune", "{tmp}/s.jsonl", "--out", f"{RO}/run", "--init", "{tiny}"],
         "{tmp}/ro is not writable", read_only(files(s_jsonl=SAMPLES))),
    Case("ro-gather-o", ["gather-tapes", T, "-o", f"{RO}/all.jsonl"], "{tmp}/ro is not writable",
         read_only(files(tapes_jsonl=TAPES))),
    Case("ro-loop-run-dir", ["loop", "--run-dir", f"{RO}/run", "--model", "{tiny}"], "{tmp}/ro is not writable",
         read_only()),
    Case("ro-loop-existing-run-dir", ["loop", "--run-dir", RO, "--model", "{tiny}"],
         "{tmp}/ro: --run-dir is not writable", read_only()),
]


@pytest.fixture
def world_tmp():
    """A case directory every user can reach (pytest's tmp_path is root-only, 0700)."""
    d = Path(tempfile.mkdtemp(prefix="gsm8kctl-ro-"))
    d.chmod(0o777)
    yield d / "case"
    for p in [d, *d.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o777)
    shutil.rmtree(d)


@pytest.mark.parametrize("case", READ_ONLY, ids=str)
def test_read_only_output_is_refused(case, world_tmp, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(badinput, "run_cli", _as_nobody)
    check_refused(case, world_tmp, tiny_model_dir)


def test_unprivileged_user_writes_next_to_the_read_only_dir(world_tmp):
    """The control: the same user, the same command, a writable directory: it works."""
    world_tmp.mkdir()
    read_only(files(tapes_jsonl=TAPES))(world_tmp)
    out = world_tmp / "all.jsonl"
    proc = _as_nobody("gather-tapes", str(world_tmp / "tapes.jsonl"), "-o", str(out), "-q")
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_uid == 65534 and len(out.read_text().splitlines()) == 2


def test_a_path_error_no_check_foresaw_is_exit_2_naming_the_path(tmp_path, capsys):
    """The CLI's safety net: an OSError about a path (EACCES, ENOENT, EROFS...) is bad input, not a crash.
    (Reading is not refusable in this table: user 65534 keeps CAP_DAC_READ_SEARCH to run at all.)"""
    import typer

    from gsm8kctl.cli import _handle_errors

    missing = tmp_path / "gone" / "x.jsonl"

    @_handle_errors
    def command():
        open(missing, encoding="utf-8")

    with pytest.raises(typer.Exit) as exc:
        command()
    assert exc.value.exit_code == 2
    assert capsys.readouterr().err.strip() == f"Error: {missing}: No such file or directory"


# --------------------------------------------------------------------------------------------
# Appending to -o, the runs that go ahead: only our own half-written last line is dropped


def test_sample_drops_only_its_own_half_line_and_keeps_a_whole_last_line(tiny_model_dir, tmp_path):
    from conftest import run_cli
    from gsm8kctl.artifacts.jsonl import read_jsonl

    common = ["--model", tiny_model_dir, "--backend", "transformers", "--n-problems", "1", "--attempts", "2",
              "--max-tokens", "4", "-q"]
    # A whole valid tape without its final newline is kept (and gets its newline) ...
    whole = tmp_path / "whole" / "tapes.jsonl"
    whole.parent.mkdir()
    kept = tape(0, id="train-00000-i0000-a00-keepme")
    whole.write_text(our_line(kept), encoding="utf-8")
    proc = run_cli("sample", "-o", str(whole), *common)
    assert proc.returncode == 0, proc.stderr
    tapes = list(read_jsonl(whole))
    assert tapes[0] == kept and [(t["problem_id"], t["attempt"]) for t in tapes] == \
        [("train-00000", 0), ("train-00000", 1)]  # attempt 0 was there: only attempt 1 sampled
    # ... while the fragment our writer left is cut, and the attempt it held is sampled again.
    frag = tmp_path / "frag" / "tapes.jsonl"
    frag.parent.mkdir()
    frag.write_text(our_line(kept) + "\n" + our_line(tape(1))[:60], encoding="utf-8")
    proc = run_cli("sample", "-o", str(frag), *common)
    assert proc.returncode == 0, proc.stderr
    lines = frag.read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[0]) == kept and len(lines) == 2 and json.loads(lines[1])["attempt"] == 1


def test_model_dir_check_passes_real_layouts_and_sees_a_file_change(tiny_model_dir, tmp_path):
    """The model-directory check takes what loaders take (our tiny model; sharded safetensors with
    an index), and a directory checked once is checked again when a file in it changes."""
    import torch
    from safetensors.torch import save_file

    from gsm8kctl.artifacts.models import check_model_dir
    from gsm8kctl.errors import UserError

    check_model_dir(Path(tiny_model_dir))
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, sharded)
    (sharded / "model.safetensors").unlink()
    save_file({"a": torch.zeros(4)}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(2, 3)}, str(sharded / "model-00002-of-00002.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 40}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                        "b": "model-00002-of-00002.safetensors"}}))
    check_model_dir(sharded)
    shard = sharded / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])  # cut short after it passed once
    with pytest.raises(UserError, match="model-00002-of-00002.safetensors: cut short"):
        check_model_dir(sharded)

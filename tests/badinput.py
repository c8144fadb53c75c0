"""Harness for the bad-input table tests: one case = one refused command line.

Every case asserts what a user is promised for bad input: exit 2, exactly one stderr line that
names the path, line or key, no traceback, no pre-existing file changed (sha256 before and
after) and nothing left behind (the same set of paths under the case's directory).

A case's strings may use `{tmp}` (the case's own directory, made fresh) and `{tiny}` (the tiny
random-init model); `setup(tmp)` creates the inputs before the snapshot is taken.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from conftest import run_cli


@dataclass
class Case:
    id: str
    args: list[str]
    expect: str  # a substring of the one error line: the path, line or key it must name
    setup: Optional[Callable[[Path], None]] = None
    stdin: Optional[str] = None
    env: dict = field(default_factory=dict)

    def __str__(self) -> str:  # pytest ids
        return self.id


def valid_tape(i: int = 0, *, rewarded: bool = False, **over) -> dict:
    """A well-formed tape of ours (attempt `i` of train-00000); `over` replaces keys."""
    t = {
        "id": f"train-00000-i0000-a{i:02d}-abcdef", "iteration": 0, "split": "train",
        "problem_id": "train-00000", "attempt": i, "model": "m", "question": "2 + 3?", "gold": "5",
        "steps": [{"kind": "question", "text": "2 + 3?"}, {"kind": "reasoning", "text": "\\boxed{5}"},
                  {"kind": "answer", "text": "5"}],
        "answer": {"strict": "5", "lenient": "5", "format": True, "correct_strict": True,
                   "correct_lenient": True, "reason": "ok"},
        "correct": rewarded, "reward": 1.0 if rewarded else 0.0, "finish_reason": "stop",
        "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5], "logprobs": [-0.1, -0.2],
        "n_messages": 2, "created": 1.7e9,
    }
    t.update(over)
    return t


def run_case(case: Case, tmp_path: Path, request) -> None:
    """`check_refused` in a fresh directory; the tiny model is built only for rows that name it."""
    tiny = request.getfixturevalue("tiny_model_dir") if any("{tiny}" in a for a in case.args) else ""
    check_refused(case, tmp_path / "case", tiny)


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` -> sha256 of its bytes ('dir' for directories)."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            rel = os.path.relpath(p, root)
            try:
                out[rel] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            except OSError:  # unreadable on purpose (a case's chmod 000 file): its mode is the state
                out[rel] = f"unreadable:{os.stat(p).st_mode:o}"
    return out


def check_refused(case: Case, tmp: Path, tiny: str = "") -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    if case.setup:
        case.setup(tmp)
    fill = {"tmp": str(tmp), "tiny": tiny}
    args = [a.format(**fill) for a in case.args]
    stdin = case.stdin.format(**fill) if case.stdin is not None else None
    before = snapshot(tmp)
    proc = run_cli(*args, input=stdin, env={k: v.format(**fill) for k, v in case.env.items()}, timeout=300)
    after = snapshot(tmp)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    shown = f"gsm8kctl {' '.join(args)}\nrc={proc.returncode}\nstderr:\n{proc.stderr[-2000:]}"
    assert proc.returncode == 2, shown
    assert "Traceback" not in proc.stderr, shown
    assert len(lines) == 1, shown
    expect = case.expect.format(**fill)
    assert expect in lines[0], f"expected {expect!r} in the error line\n{shown}"
    changed = {k for k in before if k in after and before[k] != after[k]}
    assert not changed, f"changed: {sorted(changed)}\n{shown}"
    assert set(after) == set(before), f"left behind: {sorted(set(after) - set(before))}; " \
                                      f"removed: {sorted(set(before) - set(after))}\n{shown}"

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

"""JSONL reading and writing: streamed, crash-safe, with `file:line` errors.

`-` means stdin (reading) or stdout (writing) everywhere.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from gsm8kctl.errors import UserError


def read_jsonl(path: str | Path, *, repair_tail: bool = False) -> Iterator[dict]:
    """Yield one dict per non-blank line; a bad line is a UserError naming `file:line`.

    With `repair_tail`, a last line without its newline (a writer killed mid-line) is skipped,
    so a resumed writer can continue after it.
    """
    for _, record in read_jsonl_located(path, repair_tail=repair_tail):
        yield record


def read_jsonl_located(path: str | Path, *, repair_tail: bool = False) -> Iterator[tuple[str, dict]]:
    """Like `read_jsonl`, yielding (`file:line`, record) so later checks can name the line too."""
    if str(path) == "-":
        yield from _parse_lines(sys.stdin, "<stdin>", repair_tail=False)
        return
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such file")
    if p.is_dir():
        raise UserError(f"{p}: is a directory, expected a JSONL file")
    with open(p, encoding="utf-8") as f:
        yield from _parse_lines(f, str(p), repair_tail=repair_tail)


def _parse_lines(lines: Iterable[str], name: str, *, repair_tail: bool) -> Iterator[tuple[str, dict]]:
    lineno = 0
    it = iter(lines)
    while True:
        lineno += 1
        try:
            line = next(it)
        except StopIteration:
            return
        except UnicodeDecodeError:
            raise UserError(f"{name}:{lineno}: not a text JSONL file (binary data)") from None
        if not line.strip():
            continue
        if repair_tail and not line.endswith("\n"):
            return
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{name}:{lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise UserError(f"{name}:{lineno}: expected a JSON object, got {type(record).__name__}")
        yield f"{name}:{lineno}", record


def truncate_partial_line(path: str | Path) -> int:
    """Cut a trailing partial line left by a killed writer; return the bytes removed."""
    p = Path(path)
    if not p.exists() or p.stat().st_size == 0:
        return 0
    with open(p, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        # Walk back to the last newline in 64 KiB steps; lines are a few KiB at most.
        pos = size
        while pos > 0:
            step = min(65536, pos)
            f.seek(pos - step)
            chunk = f.read(step)
            idx = chunk.rfind(b"\n")
            if idx >= 0:
                keep = pos - step + idx + 1
                break
            pos -= step
        else:
            keep = 0
        if keep < size:
            f.truncate(keep)
        return size - keep


def dumps(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))


class JsonlAppender:
    """Append records one line per `write()` syscall, so a SIGKILL never leaves half a line.

    The kernel finishes a write() to a regular file before a signal can kill the process; with
    O_APPEND and one syscall per line every line on disk is whole. `-` writes to stdout.
    """

    def __init__(self, path: str | Path, fsync_every: int = 64):
        self.path = str(path)
        self.fsync_every = fsync_every
        self._count = 0
        if self.path == "-":
            self._fd = None
        else:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        data = (dumps(record) + "\n").encode("utf-8")
        if self._fd is None:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
            return
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self._count += 1
        if self.fsync_every and self._count % self.fsync_every == 0:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a whole file through a temp file + rename: readers see the old or the new file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_jsonl(path: str | Path, records: Iterable[dict]) -> int:
    """Write all records to `path` atomically (or stream to stdout for `-`); return the count."""
    n = 0
    if str(path) == "-":
        out = sys.stdout
        for r in records:
            out.write(dumps(r) + "\n")
            n += 1
        out.flush()
        return n
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in records:
                f.write(dumps(r) + "\n")
                n += 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n

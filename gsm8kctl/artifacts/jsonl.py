"""JSONL reading and writing: streamed, crash-safe, with `file:line` errors.

`-` means stdin (reading) or stdout (writing) everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

from gsm8kctl.errors import UserError


def read_jsonl(path: str | Path, *, repair_tail: bool = False) -> "JsonlReader":
    """Yield one dict per non-blank line; a bad line is a UserError naming `file:line`.

    With `repair_tail`, a last line without its newline (a writer killed mid-line) is skipped,
    so a resumed writer can continue after it. The iterator's `where` is the `file:line` of the
    record it yielded last (like csv.reader's `line_num`), for checks made after the read.
    """
    return JsonlReader(path, repair_tail=repair_tail)


class JsonlReader:
    """The records of one JSONL file (or stdin), remembering where the last one came from."""

    def __init__(self, path: str | Path, *, repair_tail: bool = False):
        self.where = f"{'<stdin>' if str(path) == '-' else path}:0"
        self._it = read_jsonl_located(path, repair_tail=repair_tail)

    def __iter__(self) -> "JsonlReader":
        return self

    def __next__(self) -> dict:
        self.where, record = next(self._it)
        return record


def held_located(path: str | Path, records: list[dict]) -> Iterator[tuple[str, dict]]:
    """(`file:line`, record) for the records of `path` that the process that wrote it still holds,
    named as `read_jsonl_located` names the file's lines (a JSONL file we write has no blank line)."""
    return ((f"{path}:{line}", record) for line, record in enumerate(records, 1))


def read_jsonl_located(path: str | Path, *, repair_tail: bool = False) -> Iterator[tuple[str, dict]]:
    """Like `read_jsonl`, yielding (`file:line`, record) so later checks can name the line too."""
    if str(path) == "-":
        # Bytes, so that invalid UTF-8 is reported at its own line (see _parse_lines).
        yield from _parse_lines(getattr(sys.stdin, "buffer", sys.stdin), "<stdin>", repair_tail=False)
        return
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such file")
    if p.is_dir():
        raise UserError(f"{p}: is a directory, expected a JSONL file")
    with open(p, "rb") as f:
        yield from _parse_lines(f, str(p), repair_tail=repair_tail)


# Python's json reads NaN, Infinity and -Infinity (not JSON), and 1e999 as inf. A line that could
# hold such a value is walked for it (the rest are not: walking every token list costs time).
# Overflow needs an exponent of 3+ digits or a run of 300+ digits; the run is found by mapping
# every digit to "0" (one regex for all of it took 3.7x the line's JSON parse, this 0.6x:
# bench/bench_jsonl.py).
_BIG_EXPONENT = re.compile(rb"[eE]\+?[0-9]{3}")
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_ZEROS_300 = b"0" * 300


def maybe_nonfinite(line: str | bytes) -> bool:
    """Whether a JSON line could hold NaN, Infinity or a number beyond float range (no false no)."""
    raw = line.encode("utf-8") if isinstance(line, str) else line
    return (b"NaN" in raw or b"Infinity" in raw or _BIG_EXPONENT.search(raw) is not None
            or _ZEROS_300 in raw.translate(_DIGITS_TO_ZERO))


def nonfinite_key(value, path: str = "") -> str | None:
    """The key path (`logprobs[3]`, `answer.score`) of the first NaN/±inf float in `value`, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path or "the value")
    if isinstance(value, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for sub, v in items:
        found = nonfinite_key(v, sub)
        if found is not None:
            return found
    return None


def loads_strict(line: str | bytes, where: str):
    """`json.loads`, refusing non-finite numbers: a UserError naming `where` and the key."""
    if isinstance(line, bytes):
        line = line.decode("utf-8")
    value = json.loads(line)
    if maybe_nonfinite(line):
        key = nonfinite_key(value)
        if key is not None:
            raise UserError(f"{where}: {key} is not a finite number (NaN, Infinity or out of float range)")
    return value


def _parse_lines(lines: Iterable[str | bytes], name: str, *, repair_tail: bool) -> Iterator[tuple[str, dict]]:
    lineno = 0
    for line in lines:
        lineno += 1
        if isinstance(line, bytes):
            # Decoded line by line: a text-mode file decodes in chunks and reports a bad byte
            # at the first line of its chunk, not at its own.
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(f"{name}:{lineno}: not a text JSONL file (invalid UTF-8 at byte "
                                f"{exc.start} of the line)") from None
        if not line.strip():
            continue
        if repair_tail and not line.endswith("\n"):
            return
        try:
            record = loads_strict(line, f"{name}:{lineno}")
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


# Every line our writer (`dumps`) writes for a tape starts like this: a last line without its
# newline that starts so and does not parse is a tape this program left half-written.
OWN_LINE_PREFIX = b'{"id":"'


class AppendTarget:
    """An existing JSONL output, checked line by line before anything is appended to it.

    `keys` holds what `check` returned for each record; `repair()` (called only once every other
    check of the run has passed) cuts a half-written last line of ours, or gives a whole last line
    its missing newline.
    """

    def __init__(self, path: str, keys: list, cut_to: int | None = None, add_newline: bool = False):
        self.path, self.keys, self.cut_to, self.add_newline = path, keys, cut_to, add_newline

    def repair(self) -> None:
        if self.cut_to is not None:
            os.truncate(self.path, self.cut_to)
        elif self.add_newline:
            with open(self.path, "ab") as f:
                f.write(b"\n")
        self.cut_to, self.add_newline = None, False


def scan_for_append(path: str | Path, check: Callable[[dict, str], object]) -> AppendTarget:
    """Check an existing output before appending to it; nothing is changed here.

    Every complete line must be a JSON object that `check(record, "file:line")` accepts (it
    raises UserError otherwise). A last line without its newline is dropped only when it is a
    fragment of our own writer's (does not parse, starts with OWN_LINE_PREFIX); one that parses
    and passes `check` is kept. Anything else (a text file, someone else's JSON) is refused with
    its file and line, so appending never damages a file we did not write.
    """
    p = Path(path)
    if not p.exists():
        return AppendTarget(str(p), [])
    refuse = "; refusing to append to it (choose another output path)"
    keys: list = []
    offset = 0
    lineno = 0
    with open(p, "rb") as f:
        for raw in f:
            lineno += 1
            where = f"{p}:{lineno}"
            start, offset = offset, offset + len(raw)
            whole = raw.endswith(b"\n")
            if not raw.strip():
                if not whole:
                    return AppendTarget(str(p), keys, add_newline=True)
                continue
            try:
                record = loads_strict(raw, where)
            except UnicodeDecodeError:
                raise UserError(f"{where}: not a text JSONL file (binary data){refuse}") from None
            except json.JSONDecodeError as exc:
                if not whole and raw.startswith(OWN_LINE_PREFIX):
                    return AppendTarget(str(p), keys, cut_to=start)  # our half-written last line
                tail = " (an incomplete last line)" if not whole else ""
                raise UserError(f"{where}: invalid JSON ({exc.msg}){tail}{refuse}") from None
            if not isinstance(record, dict):
                raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}{refuse}")
            keys.append(check(record, where))
            if not whole:
                return AppendTarget(str(p), keys, add_newline=True)
    return AppendTarget(str(p), keys)


def dumps(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


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
            with naming(STDOUT_NAME):
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            return
        view = memoryview(data)
        start = None  # where this line began, once a short write (a full disk?) cut it
        try:  # a plain try, not `naming`: this runs once per tape
            while view:
                written = os.write(self._fd, view)
                if start is None and written < len(data):
                    start = os.fstat(self._fd).st_size - written
                view = view[written:]
            self._count += 1
            if self.fsync_every and self._count % self.fsync_every == 0:
                os.fsync(self._fd)
        except OSError as exc:
            if start is not None:  # take the cut line back: the file stays whole lines
                os.ftruncate(self._fd, start)
            named = _with_path(exc, self.path)
            if named is exc:
                raise
            raise named from exc

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                with naming(self.path):
                    os.fsync(fd)
            finally:
                os.close(fd)

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a whole file through a temp file + rename: readers see the old or the new file."""
    with replacing(path) as f:
        f.write(text)


@contextlib.contextmanager
def replacing(path: str | Path):
    """A text file that replaces `path` whole when the block ends: a temp file beside it, fsynced,
    then renamed over it, so a reader (or a crash) sees the old file or the new one, never half.

    - A symlink's target is replaced, not the link.
    - A path that is not a regular file (`/dev/null`, a FIFO) is written straight into: renaming
      over it would destroy a device node or leave a reader waiting forever.
    - The new file keeps the old one's permissions, or gets what `open()` would give (0666 less
      the umask): mkstemp's 0600 would lock others out of a shared run directory.
    - A full disk's OSError gets `path`, so the error line can name it (`naming`).
    """
    target = Path(os.path.realpath(path))
    try:
        old = os.stat(target)
    except FileNotFoundError:
        old = None
    with naming(path):
        if old is not None and not stat.S_ISREG(old.st_mode):
            with open(target, "w", encoding="utf-8") as f:
                yield f
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, stat.S_IMODE(old.st_mode) if old is not None else 0o666 & ~_umask())
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


# Errors only a write raises, which come without a file name from write() and fsync().
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
STDOUT_NAME = "<stdout>"  # what an error line calls `-o -`, as reading calls stdin <stdin>


def _with_path(exc: OSError, path: str | Path) -> OSError:
    """`exc`, or for a write error that came without a file name (a full disk) the same one naming `path`."""
    if exc.filename is not None or exc.errno not in WRITE_ERRNOS:
        return exc
    return OSError(exc.errno, exc.strerror, str(path))


@contextlib.contextmanager
def naming(path: str | Path):
    """Within: a write error that came without a file name (a full disk) is raised with `path`."""
    try:
        yield
    except OSError as exc:
        named = _with_path(exc, path)
        if named is exc:
            raise
        raise named from exc


def _umask() -> int:
    """The process's umask, read without setting it where Linux shows it (os.umask would change it
    for every thread for a moment)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n")


def write_jsonl(path: str | Path, records: Iterable[dict]) -> int:
    """Write all records to `path` atomically (or stream to stdout for `-`); return the count."""
    n = 0
    if str(path) == "-":
        with naming(STDOUT_NAME):
            for r in records:
                sys.stdout.write(dumps(r) + "\n")
                n += 1
            sys.stdout.flush()
        return n
    with replacing(path) as f:
        for r in records:
            f.write(dumps(r) + "\n")
            n += 1
    return n

def shown(value, limit: int = 40) -> str:
    """A value as JSON, cut to `limit` characters, for error messages."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."

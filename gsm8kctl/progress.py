"""Talk goes to stderr: a rich progress bar on a TTY, plain lines otherwise, nothing with --quiet."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from gsm8kctl.procs import TALK_FD_ENV, talk_fds

console = Console(stderr=True)


def keep_stdout_for_data() -> None:
    """Make file descriptor 1 a copy of stderr and give `sys.stdout` the real stdout on a private
    descriptor, so only our own writes reach the data stream.

    Libraries print and log to stdout (vLLM's logger does by default, and its engine core and
    workers inherit fd 1), which put log lines inside `sample -o -`'s JSONL. The private
    descriptor is not inherited by the programs we start; forked children get stderr as stdout.
    Called once by the command line's entry point, not by library use of the stages.
    """
    try:
        data_fd = os.dup(1)  # non-inheritable: a started program never holds the pipe open
    except OSError:  # no stdout at all (`>&-`): nothing to keep
        return
    try:
        os.dup2(2, 1)
    except OSError:  # no stderr to send talk to: leave fd 1 as it was
        os.close(data_fd)
        return
    old = sys.stdout
    sys.stdout = open(data_fd, "w", encoding=getattr(old, "encoding", None) or "utf-8",
                      errors=getattr(old, "errors", None) or "strict", closefd=True)
    os.register_at_fork(after_in_child=_stdout_to_stderr)


def _stdout_to_stderr() -> None:
    sys.stdout = sys.stderr


def library_output_to(log_path: str | os.PathLike) -> None:
    """From now on what this process and every process it starts write to stdout and stderr
    (vLLM's and transformers' logs, Python warnings, progress bars of weight loading, a stage's
    JSON result) is appended to `log_path`; our talk (`say`, `warn`, errors) stays on the
    terminal through a copy of stderr. Called by the loop once its checks have passed."""
    talk = os.dup(2)
    os.set_inheritable(talk, True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.dup2(fd, 1)  # fd 1 is a copy of stderr (keep_stdout_for_data); the data stream is not on it
    os.close(fd)
    sys.stdout.flush()
    # A library's print() too: the loop writes no data on stdout, its summary is talk.
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    os.environ[TALK_FD_ENV] = str(talk)
    _talk_to(talk)


# Set to "terminal" by a loop run with -v: its stage processes show what libraries print, too.
LIBRARY_OUTPUT_ENV = "GSM8KCTL_LIBRARY_OUTPUT"


@contextlib.contextmanager
def library_output_kept(log_path: Path | None):
    """A stage command run by hand: what libraries print meanwhile, here and in the processes it
    starts (vLLM's logs, weight-loading progress bars, FutureWarnings), is held in a temporary file
    and at the end appended to `log_path` (output.log beside the stage's output), once its
    directory exists; our talk stays on the terminal. Where there is nowhere to keep it (the run
    stopped before writing anything), the held text goes to stderr as it would have, unless the
    run refused its input (its one line says why). Nothing is held without a `log_path` (`-o -`),
    under the loop (which logs already, or shows it with -v), or with GSM8KCTL_DEBUG=1."""
    if (log_path is None or talk_fds() or os.environ.get("GSM8KCTL_DEBUG")
            or os.environ.get(LIBRARY_OUTPUT_ENV) == "terminal"):
        yield
        return
    held_fd, held = tempfile.mkstemp(prefix="gsm8kctl-", suffix=".log")
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.set_inheritable(saved[1], True)  # our talk, also for the processes we start
    os.dup2(held_fd, 1)  # fd 1 is a copy of stderr (keep_stdout_for_data); the data stream is not on it
    os.dup2(held_fd, 2)
    os.close(held_fd)
    os.environ[TALK_FD_ENV] = str(saved[1])
    _talk_to(saved[1])
    # A library's print() too. Only `-o -` writes data on stdout inside a stage, and it holds
    # nothing; --json prints after the block, on the data stream restored below.
    data, sys.stdout = sys.stdout, open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    failed = refused = False
    try:
        yield
    except BaseException as exc:
        from gsm8kctl.errors import UserError

        refused = isinstance(exc, UserError)  # bad input keeps its one line
        failed = not refused
        raise
    finally:
        sys.stdout.flush()
        sys.stdout = data
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        os.environ.pop(TALK_FD_ENV, None)
        console.file = sys.stderr
        _keep_held(Path(held), log_path, point_at_it=failed, refused=refused)


def _keep_held(held: Path, log_path: Path, point_at_it: bool, refused: bool) -> None:
    text = held.read_bytes()
    held.unlink()
    if not text:
        return
    if log_path.parent.is_dir():
        with open(log_path, "ab") as log:
            log.write(text)
        if point_at_it:
            say(f"what the libraries printed is in {log_path}", verbatim=True)
    elif not refused:  # nowhere to keep it; after a failure its cause may be in there
        sys.stderr.buffer.write(text)
        sys.stderr.flush()
    # Refused input with nowhere to keep the text: the user reads the one line that says why.


def talk_from_parent() -> None:
    """In a stage process the loop started: talk on the descriptor it passed down, if any (one
    not passed down, in a process started by someone else, is not open: talk on stderr)."""
    for fd in talk_fds():
        _talk_to(fd)


def _talk_to(fd: int) -> None:
    console.file = open(fd, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)


def error_line(message: str) -> None:
    """The one line a failed command ends with, where the user reads our talk."""
    console.file.write(message + "\n")
    console.file.flush()


def say(message: str, quiet: bool = False, *, verbatim: bool = False) -> None:
    """One line of talk on stderr. `verbatim`: print the text as it is, no rich markup or :emoji:
    codes (for text we did not write: an exception's message, JSON)."""
    if not quiet:
        console.print(message, highlight=False, soft_wrap=True,  # one message = one line, at any width
                      markup=not verbatim, emoji=not verbatim)


# Set by the loop for the phases of an iteration (its own and its child processes'): the file
# that `warn(..., record=True)` appends to, read into the iteration's `warnings` in metrics.jsonl.
WARNINGS_ENV = "GSM8KCTL_WARNINGS_FILE"


def warn(message: str, quiet: bool = False, *, record: bool = False) -> None:
    """A warning line on stderr. `record`: also a line in the loop's warnings file of this
    iteration (WARNINGS_ENV), when a loop runs this phase."""
    say(f"warning: {message}", quiet, verbatim=True)  # paths and values may hold [brackets]
    path = os.environ.get(WARNINGS_ENV) if record else None
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        import json

        with open(path, "a", encoding="utf-8") as f:  # one short line per write: a kill leaves at most its tail
            f.write(json.dumps({"warning": message}) + "\n")


class Progress:
    """Counts items and generated tokens; shows problems done and tokens/s."""

    def __init__(self, total: int, description: str, quiet: bool = False, unit: str = "problems"):
        self.total, self.description, self.quiet, self.unit = total, description, quiet, unit
        self.done = 0
        self.tokens = 0
        self.start = time.perf_counter()
        self._last_line = 0.0
        self._bar = None
        if not quiet and console.file.isatty():  # the terminal our talk goes to (library_output_to)
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=console)
            self._task = self._bar.add_task(description, total=total, rate="")
            self._bar.start()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(time.perf_counter() - self.start, 1e-9)

    def advance(self, items: int, tokens: int = 0) -> None:
        self.done += items
        self.tokens += tokens
        if self.quiet:
            return
        rate = f"{self.tokens_per_s:,.0f} tok/s"
        if self._bar is not None:
            self._bar.update(self._task, advance=items, rate=rate)
        elif time.perf_counter() - self._last_line > 5 or self.done >= self.total:
            self._last_line = time.perf_counter()
            print(f"{self.description}: {self.done}/{self.total} {self.unit}, {rate}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

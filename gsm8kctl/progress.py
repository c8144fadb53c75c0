"""Talk goes to stderr: a rich progress bar on a TTY, plain lines otherwise, nothing with --quiet."""

from __future__ import annotations

import sys
import time

from rich.console import Console

console = Console(stderr=True)


def say(message: str, quiet: bool = False, *, verbatim: bool = False) -> None:
    """One line of talk on stderr. `verbatim`: print the text as it is, no rich markup or :emoji:
    codes (for text we did not write: an exception's message, JSON)."""
    if not quiet:
        console.print(message, highlight=False, soft_wrap=True,  # one message = one line, at any width
                      markup=not verbatim, emoji=not verbatim)


class Progress:
    """Counts items and generated tokens; shows problems done and tokens/s."""

    def __init__(self, total: int, description: str, quiet: bool = False, unit: str = "problems"):
        self.total, self.description, self.quiet, self.unit = total, description, quiet, unit
        self.done = 0
        self.tokens = 0
        self.start = time.perf_counter()
        self._last_line = 0.0
        self._bar = None
        if not quiet and sys.stderr.isatty():
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

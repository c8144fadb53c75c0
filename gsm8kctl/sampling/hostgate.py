"""A gate that lets a helper thread run only while the sampling thread waits on the GPU.

Why: CPython's GIL. Every torch call releases the GIL and takes it back; when another thread is
runnable at that moment, the caller waits until that thread gives the GIL up, which it does
only every switch interval (5 ms). A CUDA sampling loop makes thousands of short calls (graph
replays, slice copies, an eager prefill's kernels), and the tape writer (grading, JSON, sqlite)
is runnable for seconds at a time, so each call can cost milliseconds. On a 2-core x86-64 VM
(2026-12-03), 3000 small in-place torch ops took 15 ms alone and 18 s beside a thread encoding
JSON (`bench/bench_host_gate.py`); on one H200 (2026-12-03, commit 398d5c0) a `sample` process's
engine spent 14 of its 31 s on the host while the GPU sat idle (docs/benchmarks.md, "The host
gate").

So the sampling thread holds the gate shut (`held`) and opens it only around its blocking waits
on the device (`released`); the helper calls `wait()` between small units of work. The helper
then runs while the GPU computes, and never while the sampling thread launches work. On leaving
`held` the gate stays open, so the helper drains what is left at full speed.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Iterator


class HostGate:
    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()

    def wait(self) -> None:
        """The helper thread, between units of work: returns at once unless the gate is held."""
        self._open.wait()

    @contextmanager
    def held(self) -> Iterator["HostGate"]:
        """The sampling thread, for the whole sampling loop."""
        interval = sys.getswitchinterval()
        # When the device wait ends, the helper is mid-unit and keeps the GIL until the next
        # switch: a shorter interval bounds that at 0.5 ms instead of 5 per wait.
        sys.setswitchinterval(min(interval, 0.0005))
        self._open.clear()
        try:
            yield self
        finally:
            self._open.set()
            sys.setswitchinterval(interval)

    @contextmanager
    def released(self) -> Iterator[None]:
        """The sampling thread, inside `held`, around one blocking wait on the device."""
        self._open.set()
        try:
            yield
        finally:
            self._open.clear()

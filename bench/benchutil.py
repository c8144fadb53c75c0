"""Shared by the benchmark scripts: the peak memory of a process tree."""

from __future__ import annotations

import resource
import threading


class PeakRSS:
    """Peak summed RSS of this process and its children (accelerate workers), sampled every 0.2 s.

    Without psutil: ru_maxrss of this process and of its largest finished child (a lifetime peak,
    not per run)."""

    def __init__(self, interval: float = 0.2):
        self.peak = 0
        self._interval = interval
        self._stop = threading.Event()
        try:
            import psutil

            self._proc = psutil.Process()
        except ImportError:
            self._proc = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        import psutil

        total = 0
        for p in [self._proc, *self._proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self._interval)

    def cpu_seconds(self) -> float:
        """User + system CPU time of the live process tree (to see how contended a run was)."""
        import psutil

        total = 0.0
        for p in [self._proc, *self._proc.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def __enter__(self):
        if self._proc is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._stop.set()
            self._thread.join()
        else:
            kb = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                     resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
            self.peak = kb * 1024

"""Child processes that never outlive us: own process group, killed with the parent."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends SIGKILL when the parent dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the process group kill on the next start still cleans up
        pass


def popen(cmd: list[str], **kwargs) -> subprocess.Popen:
    """Start `cmd` in a new process group tied to our life."""
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent, **kwargs)


def kill_group(pgid: int, grace_s: float = 10.0) -> None:
    """TERM the whole group, then KILL what is left after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.time() + grace_s
        while time.time() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def run_stage(args: list[str], *, on_start=None, env: dict | None = None) -> int:
    """Run `python -m gsm8kctl ARGS` as a child tied to us; returns its exit code.

    Ctrl-C here stops the child's whole group before returning.
    """
    proc = popen([sys.executable, "-m", "gsm8kctl", *args], env={**os.environ, **(env or {})})
    if on_start:
        on_start(proc.pid)
    try:
        return proc.wait()
    except BaseException:
        kill_group(proc.pid, grace_s=5)
        raise

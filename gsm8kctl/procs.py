"""Process lifecycle: every child we start dies with us, with everything it started; nothing else
is ever signalled.

Layout of a supervised child (a loop stage, a `vllm serve`):

    we ── supervisor (`python -m gsm8kctl.procs`, leads a new session and process group)
              └── the command ── its children (vLLM's EngineCore, workers, torch launchers ...)

- The supervisor is tied to us with `PR_SET_PDEATHSIG` (SIGTERM; it also polls its parent id once
  a second as a fallback). It is a child subreaper (`PR_SET_CHILD_SUBREAPER`): a descendant whose
  parent dies is re-parented to it, not to init, so the whole tree stays under it however deep.
- When we die, when it is told to stop (TERM/INT/HUP), or when the command exits, it TERMs its
  group and descendants, waits `grace_s`, then KILLs every descendant it can find in /proc
  (walking PPid from itself, repeatedly until none is left, reaping as it goes) and exits with the
  command's exit status (128 + N for a signal).
- PDEATHSIG alone covers only a direct child: kill -9 of the loop used to leave vLLM's engine
  core and worker (≈ 3.7 GB) orphaned to init.

A restart of the loop must tell its old stage from an unrelated process that got the same number
(after a reboot, or a pid wrap): every supervised tree carries a random token in its environment
(GSM8KCTL_STAGE_TOKEN), and a saved group is signalled only when /proc/PID/environ of one of its
processes shows that token. A 128-bit random value cannot match by chance and cannot survive a
reboot, so neither start times nor boot ids are needed. (vLLM's setproctitle zeroes the environ
area of its engine processes; the supervisor and the stage keep theirs.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

STAGE_TOKEN_ENV = "GSM8KCTL_STAGE_TOKEN"
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


# ------------------------------------------------------------------------------- small helpers
def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (a server may still lose a race for it: callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    """Does process group `pgid` exist? A group we may not signal exists too (PermissionError)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_group(pgid: int, grace_s: float = 10.0) -> None:
    """TERM the whole group, then KILL what is left after `grace_s`; returns when it is gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):  # gone, or not ours to signal
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            # Not group_alive(): a zombie leader (our unreaped child) keeps the group "existing".
            if not live_members(pgid):
                return
            time.sleep(0.1)


def _prctl():
    with contextlib.suppress(Exception):
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    return None  # not Linux: the group kill on stop and on the next start still cleans up


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None):
    """A preexec_fn: the kernel sends the child `sig` when its parent (thread) dies, even by SIGKILL.

    Everything is looked up before the fork: between fork and exec the child may only make plain
    calls (another thread could hold the import lock at fork time). If the parent died before
    prctl took effect, the child exits at once.
    """
    prctl, getppid, exit_ = _prctl(), os.getppid, os._exit
    parent = os.getpid() if parent_pid is None else parent_pid

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if getppid() != parent:
            exit_(1)
    return preexec


# ------------------------------------------------------------------------------- /proc
def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of `pid` from /proc/PID/stat, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()  # the name in parentheses may hold spaces
    return fields[0].decode(), int(fields[1]), int(fields[2])


def _pids() -> list[int]:
    try:
        return [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except FileNotFoundError:  # no /proc (not Linux): only the group kill cleans up
        return []


def live_members(pgid: int) -> list[int]:
    """Pids of process group `pgid` that have not exited (zombies excluded)."""
    out = []
    for pid in _pids():
        st = _stat(pid)
        if st is not None and st[2] == pgid and st[0] not in ("Z", "X"):
            out.append(pid)
    return out


def live_descendants(root: int) -> list[int]:
    """Pids below `root` (not zombies), by the PPid links in /proc."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for pid in _pids():
        st = _stat(pid)
        if st is not None:
            states[pid] = st[0]
            children.setdefault(st[1], []).append(pid)
    out, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        if states.get(pid) not in ("Z", "X"):
            out.append(pid)
    return out


def carries_token(pid: int, token: str) -> bool:
    """Does /proc/PID/environ hold GSM8KCTL_STAGE_TOKEN=token? False when unreadable (not ours)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return f"{STAGE_TOKEN_ENV}={token}".encode() in env.split(b"\0")


def token_processes(token: str) -> list[int]:
    """Live processes whose environment carries `token` (those that kept their environ area)."""
    return [pid for pid in _pids() if (_stat(pid) or ("Z",))[0] not in ("Z", "X") and carries_token(pid, token)]


# ------------------------------------------------------------------------------- supervised children
# The loop sends what libraries print to a log file and keeps the terminal for its own talk on
# this descriptor (progress.library_output_to); the stage processes it starts get it too.
TALK_FD_ENV = "GSM8KCTL_TALK_FD"


def talk_fds() -> tuple[int, ...]:
    """The descriptor a started process needs to talk on the terminal (for Popen's pass_fds)."""
    fd = os.environ.get(TALK_FD_ENV)
    if not (fd and fd.isdigit()):
        return ()
    try:
        os.fstat(int(fd))
    except OSError:
        return ()
    return (int(fd),)


def start_supervised(cmd: list[str], *, grace_s: float = 5.0, token: str | None = None,
                     env: dict | None = None, **popen_kwargs) -> subprocess.Popen:
    """Start `cmd` under a supervisor (module docstring) leading a new process group.

    The returned Popen is the supervisor: its pid is the group id, and `.token` the value of
    GSM8KCTL_STAGE_TOKEN in the environment of the whole tree. Start it from a long-lived thread:
    PR_SET_PDEATHSIG fires when the *thread* that forked exits.
    """
    token = token or secrets.token_hex(16)
    full_env = dict(os.environ if env is None else env)
    full_env[STAGE_TOKEN_ENV] = token
    sup = [sys.executable, "-m", "gsm8kctl.procs", "--grace", str(grace_s), "--parent", str(os.getpid()),
           "--", *cmd]
    popen_kwargs.setdefault("pass_fds", talk_fds())  # the loop's talk reaches the terminal from a stage too
    proc = subprocess.Popen(sup, env=full_env, start_new_session=True,
                            preexec_fn=die_with_parent(signal.SIGTERM), **popen_kwargs)
    proc.token = token
    return proc


def start_child(cmd: list[str], *, env: dict | None = None) -> subprocess.Popen:
    """A plain child, for a process that already runs under a supervisor (which ends the whole
    tree with it): the loop's sampler shards, finetune's `accelerate launch`. It keeps the
    loop's talk descriptor, so its warnings and errors reach the terminal."""
    return subprocess.Popen(cmd, env=env, pass_fds=talk_fds())


def call_child(cmd: list[str], *, env: dict | None = None) -> int:
    """`start_child` and wait: its exit code; the child is killed if the wait is interrupted."""
    proc = start_child(cmd, env=env)
    try:
        return proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise


@dataclass(frozen=True)
class StageRecord:
    """What the loop saves in state.json about the stage it runs, to stop it after a crash."""

    pgid: int
    token: str | None

    def to_state(self) -> dict:
        return {"child_pgid": self.pgid, "child_token": self.token}

    @staticmethod
    def cleared() -> dict:
        return {"child_pgid": None, "child_token": None}

    @classmethod
    def from_state(cls, state: dict) -> "StageRecord | None":
        return cls(int(state["child_pgid"]), state.get("child_token")) if state.get("child_pgid") else None

    def processes(self) -> list[int]:
        """Live processes that are this stage for certain: they carry its token. Empty for a
        record without a token (written by an older version): its number alone proves nothing."""
        return token_processes(self.token) if self.token else []

    def stop(self, grace_s: float = 10.0) -> bool:
        """Stop what is left of this stage; True if anything was. Nothing else is ever signalled."""
        pids = self.processes()
        if not pids:
            return False
        # A group can only be joined from inside its session, so one certain member makes the
        # whole group ours (including engine processes whose environ vLLM overwrote).
        if any((_stat(p) or ("", 0, 0))[2] == self.pgid for p in pids):
            kill_group(self.pgid, grace_s)
        for pid in self.processes():  # members that left the group (setsid), orphaned to init
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return True


def run_stage(args: list[str], *, on_start=None, env: dict | None = None, grace_s: float = 5.0,
              module: str = "gsm8kctl") -> int:
    """Run `python -m MODULE ARGS` supervised (dies with us, with all it starts); its exit code.

    `on_start(StageRecord)` is called once it runs. Ctrl-C here stops the whole tree before returning.
    """
    proc = start_supervised([sys.executable, "-m", module, *args], grace_s=grace_s,
                            env={**os.environ, **(env or {})})
    if on_start:
        on_start(StageRecord(proc.pid, proc.token))
    try:
        return proc.wait()
    except BaseException:
        kill_group(proc.pid, grace_s=grace_s + 5)  # the supervisor itself KILLs after grace_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        raise


# ------------------------------------------------------------------------------- the guard
def start_time(pid: int) -> int | None:
    """The start time of `pid` (clock ticks since boot, /proc/PID/stat field 22); None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rindex(b")") + 2:].split()[19])


class Guard:
    """Processes that must not outlive us although no supervisor is above them: vLLM's engine
    core and workers, started by an in-process engine in a stage run by hand (`gsm8kctl sample
    --backend vllm`). Killed with -9, such a stage used to leave them orphaned to init, ~3 GB.

    A guard process (`python -m gsm8kctl.procs --guard`) is given their pids and start times on
    a pipe. When our pid is no longer its parent's (we died, however), it TERMs them, waits
    `grace_s` and KILLs what is left, only where the start time still matches: a pid reused
    meanwhile is never signalled. `release()` (the engine was shut down) ends it quietly.
    """

    def __init__(self, grace_s: float = 3.0):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gsm8kctl.procs", "--guard", "--grace", str(grace_s), "--parent", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
            start_new_session=True)  # holding no stdout: a pipeline after us sees its EOF when we end

    def add(self, pids: list[int]) -> None:
        lines = [f"{pid} {t}\n" for pid in pids if pid != self.proc.pid and (t := start_time(pid)) is not None]
        self.proc.stdin.write("".join(lines))
        self.proc.stdin.flush()

    def release(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write("done\n")
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def guard(parent: int, grace_s: float) -> int:
    """The guard's side: collect `pid start` lines until "done" (exit 0) or the parent's death."""
    import select

    watched: dict[int, int] = {}
    buf = ""
    open_pipe = True
    fd = sys.stdin.fileno()

    def read(timeout: float) -> bool:
        """Take what the pipe holds; False once our owner said "done"."""
        nonlocal buf, open_pipe
        while open_pipe and select.select([fd], [], [], timeout)[0]:
            chunk = os.read(fd, 65536).decode()
            if not chunk:
                open_pipe = False  # closed by the owner's death (or still held by a forked child)
                break
            buf += chunk
            *lines, buf = buf.split("\n")
            for line in lines:
                if line == "done":
                    return False
                pid, t = line.split()
                watched[int(pid)] = int(t)
            timeout = 0.0
        return True

    while os.getppid() == parent:
        if not read(0.2):
            return 0
        if not open_pipe:
            time.sleep(0.2)
    if not read(0.0):  # what the owner wrote just before it died
        return 0

    def ours() -> list[int]:
        return [pid for pid, t in watched.items() if start_time(pid) == t and (_stat(pid) or ("Z",))[0] not in ("Z", "X")]

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for pid in ours():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.time() + wait
        while ours() and time.time() < deadline:
            time.sleep(0.1)
    return 0


# ------------------------------------------------------------------------------- the supervisor
class _Stop(Exception):
    pass


def _reap(main_pid: int) -> int | None:
    """Reap every exited child (orphans come to us as subreaper); the main child's status if it went."""
    status = None
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == main_pid:
            status = st


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


def _end_tree(grace_s: float) -> None:
    """TERM our group and every descendant, wait up to `grace_s`, KILL all that is left, reap it all."""
    me = os.getpid()
    with contextlib.suppress(OSError):
        os.killpg(me, signal.SIGTERM)  # we ignore it by now
    for pid in live_descendants(me):  # those outside our group (setsid) too
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while live_descendants(me) and time.monotonic() < deadline:
        _reap(-1)
        time.sleep(0.05)
    # KILL until nothing is left: a process forking while we kill re-parents its children to us.
    while True:
        _reap(-1)
        pids = live_descendants(me)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    _reap(-1)


def supervise(cmd: list[str], grace_s: float, parent: int) -> int:
    """Run `cmd` as a subreaper; on TERM/INT/HUP, parent death or its exit, end the whole tree."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def on_signal(signum, frame):
        raise _Stop()

    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for sig in stops:
        signal.signal(sig, on_signal)
    rc = 1
    try:
        if os.getppid() != parent:
            raise _Stop()
        # The command gets SIGKILL should we ever be killed without cleaning up.
        child = subprocess.Popen(cmd, preexec_fn=die_with_parent(signal.SIGKILL), pass_fds=talk_fds())
        # Blocked only after the fork (the mask is inherited): a SIGCHLD then wakes the wait early.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        while True:
            status = _reap(child.pid)
            if status is not None:
                child.returncode = rc = _exit_code(status)
                break  # it exited on its own: clear whatever it left behind
            if os.getppid() != parent:  # fallback when PDEATHSIG is unavailable
                raise _Stop()
            signal.sigtimedwait([signal.SIGCHLD], 1.0)
    except _Stop:
        rc = 128 + signal.SIGTERM
    finally:
        for sig in stops:
            signal.signal(sig, signal.SIG_IGN)
        sys.stdout.flush()
        sys.stderr.flush()
        _end_tree(grace_s)
    return rc


def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m gsm8kctl.procs", description="supervise one command")
    ap.add_argument("--grace", type=float, default=5.0)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--guard", action="store_true", help="guard the processes named on stdin (Guard)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.guard:
        return guard(args.parent, args.grace)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return supervise(cmd, args.grace, args.parent)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

"""Process lifecycle (gsm8kctl/procs.py): a supervised tree never outlives its parent, whatever it
forks, and a saved process group is signalled only when it carries its token."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gsm8kctl import procs
from gsm8kctl.procs import STAGE_TOKEN_ENV, StageRecord, group_alive, kill_group, start_supervised

from conftest import REPO

# A command that leaves a tree behind: a child in its group, one that left the group (setsid), and
# an orphan whose parent exited (re-parented to the nearest subreaper: the supervisor).
TREE = textwrap.dedent("""
    import os, subprocess, sys, time
    a = subprocess.Popen(["sleep", "300"])
    b = subprocess.Popen(["sleep", "301"], start_new_session=True)
    c = subprocess.Popen([sys.executable, "-c", "import subprocess; "
                          "print(subprocess.Popen(['sleep', '302'], start_new_session=True).pid)"],
                         stdout=subprocess.PIPE, text=True)
    orphan = int(c.stdout.readline())
    c.wait()
    print(os.getpid(), a.pid, b.pid, orphan, flush=True)
    if sys.argv[1:] == ["exit"]:
        sys.exit(0)
    time.sleep(300)
""")


def _alive(pid: int) -> bool:
    st = procs._stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _wait_all_gone(pids, timeout: float) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _kill(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_group_alive_counts_a_group_we_may_not_signal(monkeypatch):
    def denied(pgid, sig):
        raise PermissionError

    monkeypatch.setattr(os, "killpg", denied)
    assert group_alive(12345)


def test_exit_status_passes_through():
    assert start_supervised([sys.executable, "-c", "import sys; sys.exit(3)"]).wait() == 3
    assert start_supervised([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"]).wait() == 128 + 9


def test_token_in_the_tree_environment():
    proc = start_supervised([sys.executable, "-c", f"import os; print(os.environ['{STAGE_TOKEN_ENV}'])"],
                            stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    assert out.strip() == proc.token and len(proc.token) == 32


def test_stragglers_go_when_the_command_exits():
    proc = start_supervised([sys.executable, "-c", TREE, "exit"], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in proc.stdout.readline().split()]
    assert proc.wait(timeout=30) == 0
    left = _wait_all_gone(pids, 5)
    _kill(left)
    assert not left, "the command exited but left processes running"


def test_whole_tree_dies_with_the_parent():
    """SIGKILL the process that started the supervisor: the group, the escapee and the orphan go."""
    script = textwrap.dedent(f"""
        import sys, time
        from gsm8kctl.procs import start_supervised
        p = start_supervised([sys.executable, "-c", {TREE!r}], grace_s=2)
        print(p.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    pids = []
    try:
        sup = int(parent.stdout.readline())
        pids = [sup, *map(int, parent.stdout.readline().split())]
        assert all(_alive(p) for p in pids)
        assert set(pids[1:]) <= set(procs.live_descendants(sup))
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    t0 = time.time()
    left = _wait_all_gone(pids, 10)
    _kill(left)
    assert not left, f"outlived their parent: {left}"
    assert time.time() - t0 < 10


def test_term_stops_the_whole_tree():
    proc = start_supervised([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True, grace_s=2)
    pids = [proc.pid, *map(int, proc.stdout.readline().split())]
    kill_group(proc.pid, grace_s=10)
    proc.wait(timeout=10)
    left = _wait_all_gone(pids, 5)
    _kill(left)
    assert not left


def test_saved_group_is_signalled_only_with_its_token():
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)  # `setsid sleep 300 &`
    try:
        assert not StageRecord(stranger.pid, None).stop()  # an old record without a token
        assert not StageRecord(stranger.pid, "0" * 32).stop()
        time.sleep(0.2)
        assert stranger.poll() is None, "an unrelated process group was signalled"
    finally:
        stranger.kill()
        stranger.wait()

    proc = start_supervised([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True, grace_s=2)
    pids = [proc.pid, *map(int, proc.stdout.readline().split())]
    record = StageRecord(proc.pid, proc.token)
    assert proc.pid in record.processes()
    assert StageRecord.from_state(record.to_state()) == record
    assert StageRecord.from_state({**record.to_state(), **StageRecord.cleared()}) is None
    assert record.stop()
    proc.wait(timeout=10)
    left = _wait_all_gone(pids, 5)
    _kill(left)
    assert not left and not record.processes()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_supervisor_alone_ends_the_tree(sig):
    proc = start_supervised([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True, grace_s=2)
    pids = [proc.pid, *map(int, proc.stdout.readline().split())]
    os.kill(proc.pid, sig)
    assert proc.wait(timeout=15) == 128 + signal.SIGTERM
    left = _wait_all_gone(pids, 5)
    _kill(left)
    assert not left


# A parent that starts two sleeps, guards the first (and a pid whose start time does not match,
# as a reused pid would not), prints the pids, and waits to be killed -- or releases the guard.
GUARDED = textwrap.dedent("""
    import subprocess, sys, time
    from gsm8kctl.procs import Guard, start_time
    kept = subprocess.Popen(["sleep", "300"], start_new_session=True)
    other = subprocess.Popen(["sleep", "301"], start_new_session=True)
    g = Guard(grace_s=1.0)
    g.add([kept.pid])
    g.proc.stdin.write(f"{other.pid} {start_time(other.pid) + 1}\\n")  # not the process that runs now
    g.proc.stdin.flush()
    print(kept.pid, other.pid, g.proc.pid, flush=True)
    if sys.argv[1] == "release":
        g.release()
        print("released", flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("how", ["sigkill", "release"])
def test_guarded_processes_go_when_their_owner_is_killed(how):
    """kill -9 of the owner: the guarded process is stopped (not the one whose start time does not
    match); released first, nothing is stopped and the guard exits."""
    owner = subprocess.Popen([sys.executable, "-c", GUARDED, how], stdout=subprocess.PIPE, text=True, cwd=REPO)
    kept, other, guard = map(int, owner.stdout.readline().split())
    try:
        if how == "release":
            assert owner.stdout.readline().strip() == "released"
            assert _wait_all_gone([guard], 5) == []
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        if how == "sigkill":
            assert _wait_all_gone([kept, guard], 10) == [], "the guarded process outlived its owner"
        else:
            time.sleep(1.5)
            assert _alive(kept)
        assert _alive(other), "a process whose start time does not match was signalled"
    finally:
        _kill([kept, other, guard])

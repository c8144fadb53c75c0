import json
import re

import pytest

from gsm8kctl.artifacts.jsonl import JsonlAppender, atomic_write_json, read_jsonl, truncate_partial_line, write_jsonl
from gsm8kctl.errors import UserError


def test_read_reports_file_and_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"a": 1}\n\n{"a": 2\n')
    with pytest.raises(UserError, match=r"t.jsonl:3: invalid JSON"):
        list(read_jsonl(p))
    p.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(UserError, match=r"t.jsonl:2: expected a JSON object"):
        list(read_jsonl(p))
    with pytest.raises(UserError, match="no such file"):
        list(read_jsonl(tmp_path / "missing.jsonl"))


def test_partial_tail_is_cut_and_appending_continues(tmp_path):
    p = tmp_path / "t.jsonl"
    with JsonlAppender(p) as w:
        w.write({"a": 1})
        w.write({"a": 2})
    with open(p, "a") as f:
        f.write('{"a": 3, "b"')  # a writer killed mid-line
    assert truncate_partial_line(p) == len('{"a": 3, "b"')
    with JsonlAppender(p) as w:
        w.write({"a": 4})
    assert [r["a"] for r in read_jsonl(p)] == [1, 2, 4]


def test_atomic_writes_leave_no_temp_files(tmp_path):
    atomic_write_json(tmp_path / "m.json", {"x": 1})
    assert write_jsonl(tmp_path / "o.jsonl", ({"i": i} for i in range(3))) == 3
    assert json.loads((tmp_path / "m.json").read_text()) == {"x": 1}
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m.json", "o.jsonl"]


def test_failed_atomic_write_keeps_old_file(tmp_path):
    p = tmp_path / "o.jsonl"
    write_jsonl(p, [{"old": True}])

    def boom():
        yield {"new": 1}
        raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError):
        write_jsonl(p, boom())
    assert list(read_jsonl(p)) == [{"old": True}]
    assert [x.name for x in tmp_path.iterdir()] == ["o.jsonl"]


@pytest.mark.parametrize("value, key", [("NaN", "reward"), ("-Infinity", "reward"), ("1e999", "reward"),
                                        ("1E+400", "reward"), ("1" * 310 + ".5", "reward"),
                                        ("[0.5, " + "9" * 320 + "e0]", "reward[1]")])
def test_non_finite_numbers_are_refused_with_their_key(tmp_path, value, key):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": 1, "reward": 0.5}\n{"id": 2, "reward": %s}\n' % value)
    with pytest.raises(UserError, match=rf"t.jsonl:2: {re.escape(key)} is not a finite number"):
        list(read_jsonl(path))


def test_large_but_finite_numbers_are_read():
    """Near the bounds of the cheap pre-check: a 300-digit integer, 1e308, 299 digits then a point."""
    from gsm8kctl.artifacts.jsonl import loads_strict

    assert loads_strict('{"a": %s}' % ("7" * 300), "x")["a"] == int("7" * 300)
    assert loads_strict('{"a": 1e308, "b": %s.5}' % ("1" * 299), "x")["a"] == 1e308


# --------------------------------------------------------------------------------------------
# What a replaced output is, and what a full disk or a closed pipe does (the real CLI for those)

def _cli(*args, stdout=None, timeout=120):
    import subprocess
    import sys

    from conftest import REPO

    return subprocess.run([sys.executable, "-m", "gsm8kctl", *args], cwd=REPO, stdout=stdout or subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout)


def _tapes(tmp_path, n=3):
    from badinput import valid_tape

    p = tmp_path / "tapes.jsonl"
    p.write_text("".join(json.dumps(valid_tape(i)) + "\n" for i in range(n)))
    return p


def test_replacing_keeps_links_modes_and_special_files(tmp_path):
    import os
    import stat
    import threading

    # A symlink: its target is replaced (same mode), the link stays a link.
    target = tmp_path / "real.jsonl"
    target.write_text('{"old": 1}\n')
    target.chmod(0o640)
    (tmp_path / "link.jsonl").symlink_to(target)
    write_jsonl(tmp_path / "link.jsonl", [{"new": 1}])
    assert (tmp_path / "link.jsonl").is_symlink() and target.read_text() == '{"new":1}\n'
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    # A new file: what open() gives under the umask, not mkstemp's 0600.
    old_mask = os.umask(0o022)
    try:
        atomic_write_json(tmp_path / "new.json", {"a": 1})
    finally:
        os.umask(old_mask)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o644
    # A FIFO: written into (a reader gets the lines), not renamed over.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_jsonl(fifo, [{"a": 1}, {"a": 2}])
    reader.join(10)
    assert got == ['{"a":1}\n{"a":2}\n'] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.jsonl", "new.json", "real.jsonl"]


def test_a_line_cut_by_the_file_size_limit_is_taken_back(tmp_path):
    """A full disk shows as a short write, then an error: the appender takes the cut line back and
    raises with the path (RLIMIT_FSIZE gives the same short write then EFBIG, in a child)."""
    import subprocess
    import sys

    from conftest import REPO

    out = tmp_path / "t.jsonl"
    code = (
        "import resource, signal, sys\n"
        "from gsm8kctl.artifacts.jsonl import JsonlAppender\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (10000, 10000))\n"
        "w = JsonlAppender(sys.argv[1])\n"
        "try:\n"
        "    for i in range(1000):\n"
        "        w.write({'i': i, 'pad': 'x' * 300})\n"
        "except OSError as e:\n"
        "    print(e.errno, e.filename)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    errno_, name = proc.stdout.split()
    assert int(errno_) == 27 and name == str(out)  # EFBIG, named
    data = out.read_bytes()
    assert data.endswith(b"\n") and len(data) < 10000
    rows = [json.loads(line) for line in data.splitlines()]
    assert [r["i"] for r in rows] == list(range(len(rows))) and len(rows) >= 20


def test_a_full_device_is_one_line_and_stays_a_device(tmp_path):
    import os
    import stat

    tapes = _tapes(tmp_path)
    full = tmp_path / "full"
    os.mknod(full, 0o666 | stat.S_IFCHR, os.makedev(1, 7))  # what /dev/full is
    proc = _cli("gather-tapes", str(tapes), "-o", str(full), "-q")
    assert proc.returncode == 1 and proc.stderr.strip() == f"Error: {full}: No space left on device"
    assert stat.S_ISCHR(os.stat(full).st_mode)
    with open("/dev/full", "w") as dev_full:
        proc = _cli("stats", str(tapes), "--json", stdout=dev_full)
    assert proc.returncode == 1 and proc.stderr.strip() == "Error: <stdout>: No space left on device"


@pytest.mark.parametrize("args", [["stats", "{t}", "--json"], ["gather-tapes", "{t}", "-o", "-", "-q"],
                                  ["filter", "{t}", "--mode", "all", "--keep-uniform-groups", "-o", "-", "-q"]])
def test_a_closed_pipe_is_a_quiet_exit_0(tmp_path, args):
    """`gsm8kctl ... | head` once head has gone: no message, exit 0 (before: 120, Python's failed
    flush at exit). The pipe's reader is closed before the command starts, so every write fails."""
    import os

    tapes = _tapes(tmp_path, n=40)
    r, w = os.pipe()
    os.close(r)
    with os.fdopen(w, "w") as closed:
        proc = _cli(*[a.format(t=tapes) for a in args], stdout=closed)
    assert (proc.returncode, proc.stderr) == (0, "")

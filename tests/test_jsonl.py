import json
import re

import pytest

from gsm8kctl.errors import UserError
from gsm8kctl.jsonl import JsonlAppender, atomic_write_json, read_jsonl, truncate_partial_line, write_jsonl


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
    from gsm8kctl.jsonl import loads_strict

    assert loads_strict('{"a": %s}' % ("7" * 300), "x")["a"] == int("7" * 300)
    assert loads_strict('{"a": 1e308, "b": %s.5}' % ("1" * 299), "x")["a"] == 1e308

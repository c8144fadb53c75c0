import json

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

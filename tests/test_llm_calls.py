import pytest
import sqlite_utils

from gsm8kctl.artifacts import llm_calls

SCHEMA = """CREATE TABLE "llm_calls" (
   "id" TEXT PRIMARY KEY,
   "tape_id" TEXT,
   "created" REAL,
   "backend" TEXT,
   "model" TEXT,
   "prompt" TEXT,
   "prompt_text" TEXT,
   "completion" TEXT,
   "params" TEXT,
   "prompt_tokens" INTEGER,
   "completion_tokens" INTEGER,
   "latency_s" REAL,
   "finish_reason" TEXT
)"""


def _record(i: int) -> dict:
    return llm_calls.call_record(call_id=f"c{i}", tape_id=f"t{i % 3}", backend="transformers", model="m",
                                 messages=[{"role": "user", "content": "q"}], prompt_text="q",
                                 completion="a", params={"n": 1}, prompt_tokens=3, completion_tokens=2,
                                 latency_s=0.1, finish_reason="stop", created=1000.0 + i)


def test_final_schema_and_indexes(tmp_path):
    db = llm_calls.open_log(tmp_path / "calls.sqlite")
    assert db["llm_calls"].schema == SCHEMA
    # ("id",) is the primary key's own index.
    assert {tuple(i.columns) for i in db["llm_calls"].indexes} == {("id",), ("tape_id",), ("created",)}
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_upgrade_from_oldest_schema(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite_utils.Database(path)
    llm_calls.m001_create_llm_calls(db)  # a log made before the created index existed
    db["_sqlite_migrations"].insert({"migration_set": "gsm8kctl.artifacts.llm_calls", "name": "m001_create_llm_calls",
                                     "applied_at": "2026-01-01"}, alter=True)
    db["llm_calls"].insert(_record(1))
    db.close()
    db = llm_calls.open_log(path)
    assert ("created",) in {tuple(i.columns) for i in db["llm_calls"].indexes}
    assert db["llm_calls"].count == 1


def test_rerun_replaces_not_duplicates(tmp_path):
    db = llm_calls.open_log(tmp_path / "c.sqlite")
    llm_calls.insert_calls(db, [_record(i) for i in range(6)])
    llm_calls.insert_calls(db, [_record(i) for i in range(3)])
    assert db["llm_calls"].count == 6
    conn = llm_calls.open_readonly(tmp_path / "c.sqlite")
    assert [c["id"] for c in llm_calls.calls_for_tape(conn, "t1")] == ["c1", "c4"]


def test_a_full_log_is_a_named_oserror_and_keeps_no_half_batch(tmp_path):
    """SQLITE_FULL (a full disk; here the page limit sqlite obeys the same way) is the OSError a full
    disk is elsewhere, with the log's path, so the CLI prints one line; the batch rolls back whole."""
    import errno

    path = tmp_path / "llm_calls.sqlite"
    db = llm_calls.open_log(path)
    rows = [llm_calls.call_record(call_id=f"c{i}", tape_id=f"t{i}", backend="b", model="m", messages=[],
                                  prompt_text="p" * 3000, completion="c", params={}, prompt_tokens=1,
                                  completion_tokens=1, latency_s=0.1, finish_reason="stop", created=1.0)
             for i in range(200)]
    llm_calls.insert_calls(db, rows[:2])
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages + 20}")
    with pytest.raises(OSError) as info:
        llm_calls.insert_calls(db, rows[2:])
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert db.execute("SELECT count(*) FROM llm_calls").fetchone()[0] == 2


def test_a_log_killed_mid_checkpoint_is_not_refused_as_truncated(tmp_path):
    """Killed while sqlite copies its -wal into the file, a log's header can count more pages than
    the file holds yet; the -wal still has them. check_log lets it through, and the log opens
    with every row. The same file without its -wal is refused."""
    import shutil
    import sqlite3

    live = tmp_path / "live" / "c.sqlite"
    live.parent.mkdir()
    db = llm_calls.open_log(str(live))
    db.conn.execute("PRAGMA wal_autocheckpoint=0")
    rows = [{"id": f"call-{i}", "tape_id": f"t-{i}", "completion": "x" * 2000} for i in range(50)]
    llm_calls.insert_calls(db, rows)
    killed = tmp_path / "killed"
    killed.mkdir()
    for suffix in ("", "-wal"):  # what a kill -9 leaves: the file and its -wal, not checkpointed
        shutil.copy(str(live) + suffix, killed / ("c.sqlite" + suffix))
    db.conn.close()
    copy = killed / "c.sqlite"
    with open(copy, "r+b") as f:  # the header written ahead of the pages behind it
        header = bytearray(f.read(100))
        header[28:32] = (int.from_bytes(header[28:32], "big") + 40).to_bytes(4, "big")
        f.seek(0)
        f.write(header)
    llm_calls.check_log(copy)
    conn = sqlite3.connect(copy)
    assert conn.execute(f"SELECT count(*) FROM {llm_calls.TABLE}").fetchone()[0] == 50
    conn.close()
    lone = tmp_path / "lone" / "c.sqlite"
    lone.parent.mkdir()
    with open(copy, "rb") as src, open(lone, "wb") as dst:
        dst.write(header + src.read()[100:])
    with pytest.raises(Exception, match="truncated SQLite database"):
        llm_calls.check_log(lone)

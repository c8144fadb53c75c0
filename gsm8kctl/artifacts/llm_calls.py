"""The LLM call log: `llm_calls.sqlite`, table `llm_calls` (docs/architecture.md, "LLM call log"),
written through sqlite-utils.

WAL mode, one writer, indexed by id and tape id; schema changes are named append-only migrations
recorded in the database, so an old log opens and upgrades in place.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
from pathlib import Path
from typing import Iterable

import sqlite_utils
from sqlite_utils.db import Database

from gsm8kctl.errors import UserError

TABLE = "llm_calls"


migrations = sqlite_utils.Migrations("gsm8kctl.artifacts.llm_calls")


@migrations()
def m001_create_llm_calls(db: Database) -> None:
    db[TABLE].create(
        {
            "id": str, "tape_id": str, "created": float, "backend": str, "model": str,
            "prompt": str, "prompt_text": str, "completion": str, "params": str,
            "prompt_tokens": int, "completion_tokens": int, "latency_s": float, "finish_reason": str,
        },
        pk="id",
    )
    db[TABLE].create_index(["tape_id"])


@migrations()
def m002_created_index(db: Database) -> None:
    # The browser pages the whole table newest-first; this keeps that an index walk.
    db[TABLE].create_index(["created"])


def open_log(path: str | Path) -> Database:
    """Open (creating and migrating) the call log for writing."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        db = sqlite_utils.Database(p)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA busy_timeout=30000")
        migrations.apply(db)
    except sqlite3.DatabaseError as exc:
        raise UserError(f"{p}: cannot open the LLM call log ({exc}); move it away or pass another "
                        "--llm-calls") from None
    return db


SQLITE_MAGIC = b"SQLite format 3\x00"
# Tables of ours: the log, sqlite-utils' migration record, and any later table named after the log.
_OWN_TABLES = ("llm_calls", "_sqlite_migrations")


def check_log(path: str | Path) -> None:
    """Refuse an existing call log that is not a sound sqlite database of ours, before any work.

    Cheap whatever the size: the 100-byte header (magic, page size, page count against the file
    size, which catches a truncated copy) and the schema, read with `immutable=1` so that the
    check itself creates no -wal/-shm file and changes nothing. A log with a -wal left by a
    killed writer is read through it: the header may be ahead of the file until sqlite completes
    the checkpoint from the -wal.
    """
    p = Path(path)
    if not p.exists():
        return
    hint = "; move it away or pass another --llm-calls"
    if p.is_dir():
        raise UserError(f"{p}: is a directory, expected the LLM call log (sqlite){hint}")
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            header = f.read(100)
    except OSError as exc:
        raise UserError(f"{p}: cannot read the LLM call log ({exc.strerror})") from None
    if size == 0:
        return  # sqlite treats an empty file as an empty database
    if len(header) < 100 or not header.startswith(SQLITE_MAGIC):
        raise UserError(f"{p}: not an SQLite database (corrupt, or another kind of file){hint}")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    # The header's page count is valid when its change counter matches "version-valid-for". A
    # writer killed in the middle of a checkpoint can leave the header ahead of the file while
    # its -wal still holds every page: sqlite completes the checkpoint from it on the next open.
    wal = p.with_name(p.name + "-wal")
    pending_wal = wal.exists() and wal.stat().st_size > 0
    if header[24:28] == header[92:96] and pages and size < pages * page_size and not pending_wal:
        raise UserError(f"{p}: truncated SQLite database ({size} bytes, its header says "
                        f"{pages * page_size}){hint}")
    try:
        # With a -wal pending, read through it (the schema may be there only); else touch nothing.
        conn = sqlite3.connect(f"{p.resolve().as_uri()}?mode=ro{'' if pending_wal else '&immutable=1'}", uri=True)
        try:
            tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            columns = {r[1] for r in conn.execute(f"PRAGMA table_info({TABLE})")}
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise UserError(f"{p}: corrupt SQLite database ({exc}){hint}") from None
    foreign = [t for t in tables if not t.startswith(_OWN_TABLES) and not t.startswith("sqlite_")]
    if foreign:
        raise UserError(f"{p}: an SQLite database but not an LLM call log of ours (table {foreign[0]}){hint}")
    if TABLE in tables and not {"id", "tape_id"} <= columns:
        raise UserError(f"{p}: table {TABLE} has no id/tape_id columns: not an LLM call log of ours{hint}")


def open_readonly(path: str | Path) -> sqlite3.Connection:
    """A read-only connection (browser, stats): never creates or changes the file."""
    conn = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    return conn


def call_record(*, call_id: str, tape_id: str, backend: str, model: str, messages: list[dict],
                prompt_text: str, completion: str, params: dict, prompt_tokens: int,
                completion_tokens: int, latency_s: float, finish_reason: str, created: float) -> dict:
    return {
        "id": call_id, "tape_id": tape_id, "created": created, "backend": backend, "model": model,
        "prompt": json.dumps(messages, ensure_ascii=False), "prompt_text": prompt_text,
        "completion": completion, "params": json.dumps(params), "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens, "latency_s": round(latency_s, 4),
        "finish_reason": finish_reason,
    }


def insert_calls(db: Database, records: Iterable[dict]) -> None:
    """Insert in one transaction; a rerun of the same attempt replaces its call (same id).

    A full disk is raised as the OSError it is, with the log's path, so it gets the one line a
    full disk gets elsewhere (sqlite rolls the transaction back: no call is half in)."""
    try:
        with db.conn:
            db[TABLE].insert_all(records, pk="id", replace=True, batch_size=200)
    except sqlite3.OperationalError as exc:
        if getattr(exc, "sqlite_errorcode", None) != sqlite3.SQLITE_FULL:
            raise
        path = db.conn.execute("PRAGMA database_list").fetchone()[2]
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({exc})", path) from exc


def calls_for_tape(conn: sqlite3.Connection, tape_id: str) -> list[dict]:
    rows = conn.execute(f"SELECT * FROM {TABLE} WHERE tape_id = ? ORDER BY created", (tape_id,))
    return [dict(r) for r in rows]

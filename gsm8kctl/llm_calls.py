"""The LLM call log: `llm_calls.sqlite`, table `llm_calls` (DESIGN.md §4), written through sqlite-utils.

WAL mode, one writer, indexed by id and tape id; schema changes are named append-only migrations
recorded in the database, so an old log opens and upgrades in place.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Iterable

import sqlite_utils
from sqlite_utils.db import Database

TABLE = "llm_calls"


migrations = sqlite_utils.Migrations("gsm8kctl.llm_calls")


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
    db = sqlite_utils.Database(p)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA busy_timeout=30000")
    migrations.apply(db)
    return db


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
    """Insert in one transaction; a rerun of the same attempt replaces its call (same id)."""
    with db.conn:
        db[TABLE].insert_all(records, pk="id", replace=True, batch_size=200)


def calls_for_tape(conn: sqlite3.Connection, tape_id: str) -> list[dict]:
    rows = conn.execute(f"SELECT * FROM {TABLE} WHERE tape_id = ? ORDER BY created", (tape_id,))
    return [dict(r) for r in rows]

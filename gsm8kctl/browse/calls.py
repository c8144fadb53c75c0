"""Read-only access to `llm_calls.sqlite` for the browser: find it, page it, fetch one call.

Every query is parameterized and walks an index: the whole-table view pages newest-first over the
`created` index (falling back to rowid order in a log without it), 100 rows at a time, and reads
only short columns plus a prefix of the completion; nothing loads the table.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

from gsm8kctl.artifacts.rundir import CHECKPOINTS_DIR, CONFIG_FILE, ITERATIONS_DIR, LLM_CALLS_FILE, STATE_FILE
from gsm8kctl.errors import UserError

TABLE = "llm_calls"
CALLS_PER_PAGE = 100
# How far above PATH the search for llm_calls.sqlite goes. A run directory is
# runs/NAME/{iterations,eval}/0003/tapes.jsonl: the log is two levels above a tapes file.
MAX_PARENTS = 3
_RUN_DIR_MARKERS = (STATE_FILE, CONFIG_FILE, ITERATIONS_DIR, CHECKPOINTS_DIR)
_LIST_COLUMNS = ("id", "tape_id", "created", "backend", "model", "prompt_tokens",
                 "completion_tokens", "latency_s", "finish_reason")
SNIPPET_CHARS = 120


def find_llm_calls(path: str | Path) -> Path | None:
    """The nearest llm_calls.sqlite beside PATH or in its parents, up to the run directory.

    Bounded three ways: at most MAX_PARENTS levels up, never above a directory that looks like
    a run directory, never past the filesystem root.
    """
    d = Path(path).resolve()
    if not d.is_dir():
        d = d.parent
    for _ in range(MAX_PARENTS + 1):
        candidate = d / LLM_CALLS_FILE
        if candidate.is_file():
            return candidate
        if any((d / m).exists() for m in _RUN_DIR_MARKERS) or d.parent == d:
            return None
        d = d.parent
    return None


def _open_ro(path: Path, immutable: bool = False) -> sqlite3.Connection:
    # as_uri() percent-encodes the path, so '?' or '#' in a directory name cannot inject
    # URI parameters. mode=ro never writes the database; like any reader of a WAL-mode log,
    # SQLite may create its -shm/-wal side files (empty) when they are missing.
    uri = f"{path.resolve().as_uri()}?mode=ro" + ("&immutable=1" if immutable else "")
    conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    return conn


class CallStore:
    """The LLM call log, opened read-only. `error` says why calls are unavailable, if they are."""

    def __init__(self, path: Path | None, error: str | None = None):
        self.path = path
        self.error = error
        self.conn: sqlite3.Connection | None = None
        self.columns: set[str] = set()
        self.order = "rowid DESC"
        self._lock = threading.Lock()
        if path is None or error:
            self.error = error or "no llm_calls.sqlite found"
            return
        try:
            try:
                conn = _open_ro(path)
                conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            except sqlite3.OperationalError:
                # A WAL log in a read-only directory without its -shm file: nobody can be
                # writing it, so reading it as immutable is safe.
                conn = _open_ro(path, immutable=True)
            found = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (TABLE,))
            if found.fetchone() is None:
                conn.close()
                self.error = f"{path} has no '{TABLE}' table"
                return
            self.columns = {r["name"] for r in conn.execute(f"PRAGMA table_info({TABLE})")}
            indexed = set()
            for ix in conn.execute(f"PRAGMA index_list({TABLE})").fetchall():
                cols = [r["name"] for r in conn.execute("SELECT name FROM pragma_index_info(?)", (ix["name"],))]
                if cols:
                    indexed.add(cols[0])
            if "created" in indexed:
                self.order = "created DESC, rowid DESC"
            self.conn = conn
        except sqlite3.Error as exc:
            self.error = f"cannot read {path}: {exc}"

    @classmethod
    def open(cls, tapes_path: Path, explicit: str | Path | None) -> "CallStore":
        if explicit is not None:
            p = Path(explicit)
            if not p.is_file():
                raise UserError(f"{p}: no such LLM call database (--llm-calls)")
            return cls(p)
        found = find_llm_calls(tapes_path)
        if found is None:
            return cls(None, f"no {LLM_CALLS_FILE} beside {tapes_path} or in its run directory "
                             "(use --llm-calls DB)")
        return cls(found)

    @property
    def available(self) -> bool:
        return self.conn is not None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def _cols(self) -> str:
        cols = [c for c in _LIST_COLUMNS if c in self.columns]
        if "completion" in self.columns:
            cols.append(f"substr(completion, 1, {SNIPPET_CHARS}) AS snippet")
        return ", ".join(cols)

    def count(self, tape_id: str | None = None) -> int:
        if self.conn is None:
            return 0
        with self._lock:
            if tape_id is not None and "tape_id" in self.columns:
                return self.conn.execute(f"SELECT count(*) FROM {TABLE} WHERE tape_id = ?", (tape_id,)).fetchone()[0]
            return self.conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0]

    def page(self, page: int, tape_id: str | None = None, per_page: int = CALLS_PER_PAGE) -> list[dict]:
        """One page (1-based) of calls, newest first; the inner query is an index-only walk."""
        if self.conn is None:
            return []
        offset = (page - 1) * per_page
        with self._lock:
            if tape_id is not None and "tape_id" in self.columns:
                rows = self.conn.execute(
                    f"SELECT {self._cols()} FROM {TABLE} WHERE tape_id = ? ORDER BY {self.order} LIMIT ? OFFSET ?",
                    (tape_id, per_page, offset))
            else:
                rows = self.conn.execute(
                    f"SELECT {self._cols()} FROM {TABLE} WHERE rowid IN"
                    f" (SELECT rowid FROM {TABLE} ORDER BY {self.order} LIMIT ? OFFSET ?)"
                    f" ORDER BY {self.order}", (per_page, offset))
            return [dict(r) for r in rows]

    def for_tape(self, tape_id: str, limit: int = 50) -> list[dict]:
        if self.conn is None or "tape_id" not in self.columns:
            return []
        with self._lock:
            order = "created, rowid" if "created" in self.columns else "rowid"
            rows = self.conn.execute(
                f"SELECT {self._cols()} FROM {TABLE} WHERE tape_id = ? ORDER BY {order} LIMIT ?", (tape_id, limit))
            return [dict(r) for r in rows]

    def get(self, call_id: str) -> dict | None:
        if self.conn is None or "id" not in self.columns:
            return None
        with self._lock:
            row = self.conn.execute(f"SELECT * FROM {TABLE} WHERE id = ?", (call_id,)).fetchone()
        if row is None:
            return None
        call = dict(row)
        call["messages"] = _messages(call.get("prompt"))
        call["params_pretty"] = _pretty(call.get("params"))
        return call

    def query_plan(self, page: int = 2) -> str:
        """EXPLAIN QUERY PLAN of the whole-table page query (tests check it uses an index)."""
        assert self.conn is not None
        with self._lock:
            rows = self.conn.execute(
                f"EXPLAIN QUERY PLAN SELECT {self._cols()} FROM {TABLE} WHERE rowid IN"
                f" (SELECT rowid FROM {TABLE} ORDER BY {self.order} LIMIT ? OFFSET ?) ORDER BY {self.order}",
                (CALLS_PER_PAGE, (page - 1) * CALLS_PER_PAGE)).fetchall()
        return "\n".join(r["detail"] for r in rows)


def _messages(prompt: str | None) -> list[dict] | None:
    """Chat messages from the stored prompt JSON; None when it is not a message list."""
    if not prompt:
        return None
    try:
        value = json.loads(prompt)
    except (json.JSONDecodeError, TypeError):
        return None
    if not isinstance(value, list):
        return None
    out = []
    for m in value:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        if not isinstance(content, str):
            content = json.dumps(content, indent=2, ensure_ascii=False)
        out.append({"role": str(m.get("role", "?")), "content": content})
    return out


def _pretty(params: str | None) -> str | None:
    if not params:
        return None
    try:
        return json.dumps(json.loads(params), indent=2, ensure_ascii=False, sort_keys=True)
    except (json.JSONDecodeError, TypeError):
        return str(params)

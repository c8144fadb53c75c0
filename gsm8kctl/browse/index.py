"""A byte-offset index over tape files: what the browser filters, sorts and pages on.

One pass over each file keeps, per tape, a compact row (file, byte offset and length of its line,
iteration, split, problem, attempt, outcome, reward, token counts, a question snippet) plus the
lowercased question + completion for text search. Rows live in a private temporary sqlite
database (`sqlite3.connect("")`): on disk, not in the process's memory beyond sqlite's page cache,
and deleted when the connection closes. A tape itself is read from its file, by offset, only when
its page is shown; nothing ever holds the whole file.

Indexing parses only the head of each line: a tape written by `gsm8kctl.artifacts.tapes.make_tape` has all
scalar fields before `prompt_token_ids`, and the three token arrays are most of its bytes. Any
line that does not have that shape is parsed whole, so the fast path changes speed, not results.
"""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from gsm8kctl.artifacts.jsonl import loads_strict, maybe_nonfinite
from gsm8kctl.artifacts.rundir import EVAL_DIR, ITERATIONS_DIR, TAPES_FILE
from gsm8kctl.artifacts.tapes import outcome
from gsm8kctl.errors import UserError

OUTCOMES = ("correct", "wrong", "unparsable", "overflow")
SORTS = ("file", "-file", "reward", "-reward", "length", "-length", "problem", "-problem")
SORT_LABELS = {
    "file": "file order", "-file": "file order, last first", "reward": "reward, lowest first",
    "-reward": "reward, highest first", "length": "length, shortest first",
    "-length": "length, longest first", "problem": "problem", "-problem": "problem, descending",
}
# Sort keys: constant SQL expressions (never user text), ending in a unique (file, offset) so that
# keyset comparisons for previous/next are total. NULLs sort through sentinels.
_SORT_KEYS = {
    "file": ("file", "offset"),
    "reward": ("coalesce(reward, -1e308)", "file", "offset"),
    "length": ("coalesce(n_tokens, -1)", "n_chars", "file", "offset"),
    "problem": ("coalesce(problem_id, '')", "coalesce(iteration, -1)", "coalesce(attempt, -1)", "file", "offset"),
}
SNIPPET_CHARS = 140
MAX_QUERY_CHARS = 200
_SEARCH_CACHE = 8  # text searches whose matches are kept (a search, then paging and prev/next)
_REFRESH_EVERY_S = 2.0  # stat the known files at most this often (a loop may be appending)
_DISCOVER_EVERY_S = 10.0  # walk the directory for new files at most this often
_BATCH = 2000

# Compact separators (our writer) and json.dumps' defaults (", ", ": ").
_HEAD_CUTS = (b',"prompt_token_ids":', b', "prompt_token_ids": ')
_COMPLETION_KEY = b'"completion_token_ids":'
_HEAD_NEEDS = ("id", "steps", "finish_reason")
_ITER_DIR_RE = re.compile(r"^\d+$")


@dataclass(frozen=True)
class Filters:
    """What the tape list is narrowed to; None = no filter. Built from validated query params."""

    iteration: int | None = None
    split: str | None = None
    outcome: str | None = None
    reward: float | None = None
    problem: str | None = None
    q: str | None = None
    file: int | None = None

    def is_empty(self) -> bool:
        return self == Filters()


@dataclass
class _File:
    path: Path
    rel: str
    ino: int = -1
    indexed_to: int = 0  # bytes of whole lines indexed so far
    tapes: int = 0
    bad_lines: int = 0
    not_tapes: int = 0
    duplicates: int = 0
    first_bad: str = ""
    hint: dict = field(default_factory=dict)


def is_inside(path: Path, root: Path) -> bool:
    """True if `path`, symlinks resolved, is `root` or under it: a link out of PATH is not served."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def discover_tape_files(root: Path) -> list[Path]:
    """The tapes files under a run directory (or the file itself), in a stable order.

    Only files whose real path is inside the directory's real path: a symlink pointing out of it
    (to another user's run, to /etc) is skipped, as are symlinked directories (os.walk).
    """
    if root.is_file():
        return [root]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Hidden entries: .git, and the temp files of atomic writers (.tapes.jsonl.x.tmp).
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            if name == TAPES_FILE or name.endswith(".tapes.jsonl") or name.endswith("_tapes.jsonl"):
                if is_inside(Path(dirpath) / name, root):
                    found.append(Path(dirpath) / name)

    def order(p: Path) -> tuple:
        # Iteration by iteration, training tapes before that iteration's evaluation.
        hint = _path_hint(str(p.relative_to(root)))
        return (hint.get("iteration", -1), hint.get("split") != "train", str(p))

    return sorted(found, key=order)


def _path_hint(rel: str) -> dict:
    """iterations/0003/tapes.jsonl -> iteration 3, split train; eval/0003/ -> test."""
    parts = Path(rel).parts
    for i in range(len(parts) - 2, 0, -1):
        if _ITER_DIR_RE.match(parts[i]) and parts[i - 1] in (ITERATIONS_DIR, EVAL_DIR):
            return {"iteration": int(parts[i]), "split": "train" if parts[i - 1] == ITERATIONS_DIR else "test"}
    return {}


def completion_text(tape: dict) -> str:
    """The model's output: the text of the reasoning step(s)."""
    parts = [s.get("text") or "" for s in tape.get("steps") or []
             if isinstance(s, dict) and s.get("kind") == "reasoning"]
    return "\n".join(str(p) for p in parts)


def _count_array(line: bytes, key: bytes, start: int) -> int | None:
    """Length of the number array after `key` (commas + 1), None if absent or null."""
    k = line.find(key, start)
    if k < 0:
        return None
    i = k + len(key)
    while line[i:i + 1] == b" ":
        i += 1
    if line[i:i + 1] != b"[":
        return None
    end = line.find(b"]", i)
    if end < 0:
        return None
    if end == i + 1:
        return 0
    return line.count(b",", i, end) + 1


def _parse_head(line: bytes) -> tuple[dict, int | None] | None:
    """(tape fields up to prompt_token_ids, number of completion tokens), or None."""
    for marker in _HEAD_CUTS:
        cut = line.find(marker)
        if cut >= 0:
            break
    else:
        return None
    try:
        head = json.loads(line[:cut] + b"}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(head, dict) or any(k not in head for k in _HEAD_NEEDS):
        return None
    return head, _count_array(line, _COMPLETION_KEY, cut)


def _row_of(tape: dict, n_tokens: int | None, hint: dict) -> tuple:
    question = tape.get("question")
    if not isinstance(question, str):
        question = next((str(s.get("text", "")) for s in tape.get("steps") or []
                         if isinstance(s, dict) and s.get("kind") == "question"), "")
    completion = completion_text(tape)
    answer = tape.get("answer") if isinstance(tape.get("answer"), dict) else {}
    reward = tape.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        reward = None
    iteration = tape.get("iteration")
    if isinstance(iteration, bool) or not isinstance(iteration, int):
        iteration = hint.get("iteration")
    split = tape.get("split")
    split = str(split) if split is not None else hint.get("split")
    attempt = tape.get("attempt")
    attempt = attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else None
    problem = tape.get("problem_id")
    try:
        oc = outcome(tape)
    except TypeError:  # a reward of the wrong type in some old file
        oc = "wrong"
    snippet = " ".join(question.split())[:SNIPPET_CHARS]
    return (
        str(tape["id"]), iteration, split, None if problem is None else str(problem), attempt, oc,
        None if reward is None else float(reward), _flag(tape.get("correct")),
        _flag(answer.get("correct_strict")), _flag(answer.get("correct_lenient")), _flag(answer.get("format")),
        tape.get("finish_reason") if isinstance(tape.get("finish_reason"), str) else None,
        n_tokens, len(completion), snippet, (question + "\n" + completion).lower(),
    )


def _flag(v) -> int | None:
    return None if v is None else int(bool(v))


class TapeIndex:
    """The index of every tape file under `root`; safe to share between request threads."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.files: list[_File] = []
        self.generation = 0  # bumps whenever rows change; caches key on it
        self.build_seconds = 0.0
        self._lock = threading.RLock()
        self._last_refresh = 0.0
        self._last_discover = -1e9
        self._searches: dict[str, int] = {}  # query -> search id, oldest first
        self._next_search = 0
        self._cache: dict[str, tuple[int, object]] = {}
        self.conn = sqlite3.connect("", check_same_thread=False)
        self.conn.executescript(
            """
            PRAGMA journal_mode = OFF;
            PRAGMA synchronous = OFF;
            PRAGMA cache_size = -32000;
            PRAGMA temp_store = FILE;
            CREATE TABLE tapes (
                rid INTEGER PRIMARY KEY, id TEXT NOT NULL, file INTEGER NOT NULL,
                offset INTEGER NOT NULL, length INTEGER NOT NULL,
                iteration INTEGER, split TEXT, problem_id TEXT, attempt INTEGER, outcome TEXT,
                reward REAL, correct INTEGER, correct_strict INTEGER, correct_lenient INTEGER,
                fmt INTEGER, finish_reason TEXT, n_tokens INTEGER, n_chars INTEGER, snippet TEXT
            );
            CREATE UNIQUE INDEX tapes_id ON tapes(id);
            CREATE INDEX tapes_order ON tapes(file, offset);
            CREATE INDEX tapes_problem ON tapes(problem_id, iteration, split);
            CREATE INDEX tapes_outcome ON tapes(outcome);
            CREATE TABLE texts (rid INTEGER PRIMARY KEY, text TEXT NOT NULL);
            CREATE TABLE search (sid INTEGER NOT NULL, rid INTEGER NOT NULL, PRIMARY KEY (sid, rid)) WITHOUT ROWID;
            """
        )
        self.refresh(force=True)

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    # ---------------------------------------------------------------------------------------
    # Building and keeping up with files that grow (a loop still writing its tapes)

    def refresh(self, force: bool = False) -> bool:
        """Index new files and new lines; reindex a file that was replaced. True if rows changed."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._last_refresh < _REFRESH_EVERY_S:
                return False
            start = time.perf_counter()
            changed = False
            known = {f.path: f for f in self.files}
            discover = force or now - self._last_discover >= _DISCOVER_EVERY_S
            if discover:
                self._last_discover = now
            for p in discover_tape_files(self.root) if discover and self.root.exists() else []:
                if p not in known:
                    rel = p.name if self.root.is_file() else str(p.relative_to(self.root))
                    f = _File(path=p, rel=rel, hint=_path_hint(rel))
                    self.files.append(f)
                    known[p] = f
            for idx, f in enumerate(self.files):
                changed |= self._refresh_file(idx, f)
            if changed:
                self.generation += 1
                self.conn.execute("DELETE FROM search")
                self._searches.clear()
                self._cache.clear()
            self._last_refresh = time.monotonic()
            if force:
                self.build_seconds = time.perf_counter() - start
            return changed

    def _refresh_file(self, idx: int, f: _File) -> bool:
        try:
            st = f.path.stat()
        except OSError:
            st = None
        replaced = st is None or (f.ino not in (-1, st.st_ino)) or st.st_size < f.indexed_to
        if replaced and (f.tapes or f.indexed_to):
            # Rewritten (atomic replace, truncation) or removed: its rows are stale.
            self.conn.execute("DELETE FROM texts WHERE rid IN (SELECT rid FROM tapes WHERE file = ?)", (idx,))
            self.conn.execute("DELETE FROM tapes WHERE file = ?", (idx,))
            f.indexed_to = f.tapes = f.bad_lines = f.not_tapes = f.duplicates = 0
            f.first_bad = ""
            f.ino = -1
            if st is None:
                return True
        if st is None:
            return False
        f.ino = st.st_ino
        if st.st_size == f.indexed_to:
            return replaced
        self._index_file(idx, f)
        return True

    def _index_file(self, idx: int, f: _File) -> None:
        rows: list[tuple] = []
        texts: list[str] = []
        if not is_inside(f.path, self.root):
            return  # replaced by a symlink out of PATH since it was found
        try:
            fh = open(f.path, "rb")
        except OSError:
            return
        with fh:
            fh.seek(f.indexed_to)
            offset = f.indexed_to
            for line in fh:
                if not line.endswith(b"\n"):
                    break  # a line still being written: index it on a later refresh
                start, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                # A line that may hold NaN/Infinity is parsed whole, so that it is refused wherever
                # the value is (the head parse would not see a NaN among the logprobs).
                parsed = None if maybe_nonfinite(line) else _parse_head(line)
                if parsed is not None:
                    tape, n_tokens = parsed
                else:
                    try:
                        tape = loads_strict(line, f"line at byte {start}")
                    except (json.JSONDecodeError, UnicodeDecodeError, UserError) as exc:
                        f.bad_lines += 1
                        if not f.first_bad:
                            f.first_bad = (str(exc) if isinstance(exc, UserError) else
                                           f"line at byte {start}: {getattr(exc, 'msg', None) or exc}")
                        continue
                    if not isinstance(tape, dict):
                        f.not_tapes += 1
                        continue
                    ids = tape.get("completion_token_ids")
                    n_tokens = len(ids) if isinstance(ids, list) else None
                if tape.get("id") is None or not isinstance(tape.get("steps", []), list):
                    f.not_tapes += 1
                    continue
                row = _row_of(tape, n_tokens, f.hint)
                rows.append((idx, start, len(line)) + row[:-1])
                texts.append(row[-1])
                if len(rows) >= _BATCH:
                    self._insert(f, rows, texts)
                    rows, texts = [], []
            self._insert(f, rows, texts)
            f.indexed_to = offset

    def _insert(self, f: _File, rows: list[tuple], texts: list[str]) -> None:
        if not rows:
            return
        with self.conn:
            for row, text in zip(rows, texts):
                cur = self.conn.execute(
                    "INSERT OR IGNORE INTO tapes (file, offset, length, id, iteration, split, problem_id,"
                    " attempt, outcome, reward, correct, correct_strict, correct_lenient, fmt,"
                    " finish_reason, n_tokens, n_chars, snippet) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    row,
                )
                if cur.rowcount == 1:
                    self.conn.execute("INSERT INTO texts (rid, text) VALUES (?, ?)", (cur.lastrowid, text))
                    f.tapes += 1
                else:
                    f.duplicates += 1  # the same tape id earlier in this or another file

    # ---------------------------------------------------------------------------------------
    # Queries

    def _where(self, flt: Filters) -> tuple[str, list]:
        clauses, params = [], []
        # Equality filters: column names are constants here, values always bound parameters.
        for column, value in (("iteration", flt.iteration), ("split", flt.split), ("outcome", flt.outcome),
                              ("reward", flt.reward), ("problem_id", flt.problem), ("file", flt.file)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        if flt.q:
            clauses.append("rid IN (SELECT rid FROM search WHERE sid = ?)")
            params.append(self._search_id(flt.q))
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", params

    def _search_id(self, q: str) -> int:
        """Run a text search once (a scan of the texts) and keep its matches for paging."""
        needle = q.lower()
        sid = self._searches.pop(needle, None)
        if sid is None:
            sid = self._next_search
            self._next_search += 1
            with self.conn:
                self.conn.execute("INSERT INTO search (sid, rid) SELECT ?, rid FROM texts WHERE instr(text, ?) > 0",
                                  (sid, needle))
            while len(self._searches) >= _SEARCH_CACHE:
                old = next(iter(self._searches))
                with self.conn:
                    self.conn.execute("DELETE FROM search WHERE sid = ?", (self._searches.pop(old),))
        self._searches[needle] = sid  # most recently used last
        return sid

    @staticmethod
    def _order(sort: str) -> tuple[tuple[str, ...], bool]:
        desc = sort.startswith("-")
        return _SORT_KEYS[sort.lstrip("-")], desc

    def count(self, flt: Filters) -> int:
        with self._lock:
            where, params = self._where(flt)
            return self.conn.execute(f"SELECT count(*) FROM tapes{where}", params).fetchone()[0]

    def page(self, flt: Filters, sort: str, offset: int, limit: int) -> list[dict]:
        keys, desc = self._order(sort)
        direction = " DESC" if desc else ""
        order = ", ".join(k + direction for k in keys)
        with self._lock:
            where, params = self._where(flt)
            cur = self.conn.execute(
                f"SELECT * FROM tapes{where} ORDER BY {order} LIMIT ? OFFSET ?", params + [limit, offset])
            return self._dicts(cur)

    def neighbours(self, row: dict, flt: Filters, sort: str) -> tuple[dict | None, dict | None, int]:
        """(previous, next, 1-based position) of a tape in the filtered, sorted list."""
        keys, desc = self._order(sort)
        with self._lock:
            vals = list(self.conn.execute(f"SELECT {', '.join(keys)} FROM tapes WHERE rid = ?",
                                          (row["rid"],)).fetchone())
            where, params = self._where(flt)
            tup = "(" + ", ".join(keys) + ")"
            marks = "(" + ", ".join("?" for _ in keys) + ")"
            joiner = " AND " if where else " WHERE "
            before, after = ("<", ">") if not desc else (">", "<")
            asc_order = ", ".join(k + (" DESC" if desc else "") for k in keys)
            rev_order = ", ".join(k + ("" if desc else " DESC") for k in keys)
            nxt = self._dicts(self.conn.execute(
                f"SELECT * FROM tapes{where}{joiner}{tup} {after} {marks} ORDER BY {asc_order} LIMIT 1",
                params + vals))
            prv = self._dicts(self.conn.execute(
                f"SELECT * FROM tapes{where}{joiner}{tup} {before} {marks} ORDER BY {rev_order} LIMIT 1",
                params + vals))
            position = self.conn.execute(
                f"SELECT count(*) FROM tapes{where}{joiner}{tup} {before} {marks}", params + vals).fetchone()[0] + 1
            return (prv[0] if prv else None), (nxt[0] if nxt else None), position

    def matches(self, row: dict, flt: Filters) -> bool:
        with self._lock:
            where, params = self._where(flt)
            joiner = " AND " if where else " WHERE "
            return self.conn.execute(f"SELECT 1 FROM tapes{where}{joiner}rid = ?",
                                     params + [row["rid"]]).fetchone() is not None

    def row(self, tape_id: str) -> dict | None:
        with self._lock:
            rows = self._dicts(self.conn.execute("SELECT * FROM tapes WHERE id = ?", (tape_id,)))
            return rows[0] if rows else None

    def has(self, tape_ids: list[str]) -> set[str]:
        """Which of these tape ids are in the index (for links from the calls pages)."""
        if not tape_ids:
            return set()
        with self._lock:
            marks = ",".join("?" for _ in tape_ids)
            return {r[0] for r in self.conn.execute(f"SELECT id FROM tapes WHERE id IN ({marks})", tape_ids)}

    def load(self, row: dict) -> dict | None:
        """The whole tape, read from its file by offset (None if the file changed under us)."""
        f = self.files[row["file"]]
        if not is_inside(f.path, self.root):
            return None
        try:
            with open(f.path, "rb") as fh:
                fh.seek(row["offset"])
                data = fh.read(row["length"])
            tape = loads_strict(data, f.rel)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, UserError):
            return None
        if not isinstance(tape, dict) or str(tape.get("id")) != row["id"]:
            return None
        return tape

    def siblings(self, row: dict, limit: int = 200) -> list[dict]:
        """The attempts at the same problem in the same iteration and split."""
        with self._lock:
            return self._dicts(self.conn.execute(
                "SELECT * FROM tapes WHERE problem_id IS ? AND iteration IS ? AND split IS ?"
                " ORDER BY attempt, file, offset LIMIT ?",
                (row["problem_id"], row["iteration"], row["split"], limit)))

    def total(self) -> int:
        with self._lock:
            return self.conn.execute("SELECT count(*) FROM tapes").fetchone()[0]

    def facets(self) -> dict:
        """Values for the filter menus (cached until the rows change)."""
        return self._cached("facets", self._facets)

    def _facets(self) -> dict:
        c = self.conn
        return {
            "iterations": [r[0] for r in c.execute(
                "SELECT DISTINCT iteration FROM tapes WHERE iteration IS NOT NULL ORDER BY 1")],
            "splits": [r[0] for r in c.execute("SELECT DISTINCT split FROM tapes WHERE split IS NOT NULL ORDER BY 1")],
            "rewards": [r[0] for r in c.execute(
                "SELECT DISTINCT reward FROM tapes WHERE reward IS NOT NULL ORDER BY 1 LIMIT 50")],
            "outcomes": dict(c.execute("SELECT outcome, count(*) FROM tapes GROUP BY outcome").fetchall()),
        }

    def summary(self) -> dict:
        return self._cached("summary", self._summary)

    def _summary(self) -> dict:
        from gsm8kctl.artifacts.tapes import pass_at_k

        c = self.conn
        groups: dict[tuple, dict] = {}
        for r in c.execute(
            "SELECT file, iteration, split, count(*), sum(correct), sum(correct_strict),"
            " sum(correct_lenient), sum(fmt), sum(outcome = 'overflow'), sum(outcome = 'unparsable'),"
            " avg(reward), avg(n_tokens), count(DISTINCT problem_id)"
            " FROM tapes GROUP BY file, iteration, split ORDER BY file, iteration, split"
        ):
            n = r[3]
            groups[(r[0], r[1], r[2])] = {
                "file": self.files[r[0]].rel, "iteration": r[1], "split": r[2], "tapes": n,
                "problems": r[12], "accuracy": (r[4] or 0) / n, "accuracy_strict": (r[5] or 0) / n,
                "accuracy_lenient": (r[6] or 0) / n, "format_rate": (r[7] or 0) / n,
                "overflow_rate": (r[8] or 0) / n, "unparsable_rate": (r[9] or 0) / n,
                "mean_reward": r[10], "mean_tokens": r[11], "k": None, "pass_at_k": None,
            }
        # pass@k per group, k = the fewest attempts any problem of the group has.
        per_problem: dict[tuple, list[tuple[int, int]]] = {}
        for r in c.execute("SELECT file, iteration, split, count(*), sum(coalesce(correct, 0)) FROM tapes"
                           " GROUP BY file, iteration, split, problem_id"):
            per_problem.setdefault((r[0], r[1], r[2]), []).append((r[3], r[4]))
        for key, nc in per_problem.items():
            k = min(n for n, _ in nc)
            groups[key]["k"] = k
            groups[key]["pass_at_k"] = sum(pass_at_k(n, cc, k) for n, cc in nc) / len(nc)
        files = [{"rel": f.rel, "tapes": f.tapes, "bad_lines": f.bad_lines, "first_bad": f.first_bad,
                  "not_tapes": f.not_tapes, "duplicates": f.duplicates} for f in self.files]
        return {"groups": list(groups.values()), "files": files, "total": self.total(),
                "outcomes": dict(c.execute("SELECT outcome, count(*) FROM tapes GROUP BY outcome").fetchall())}

    def _cached(self, key: str, fn):
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] == self.generation:
                return hit[1]
            value = fn()
            self._cache[key] = (self.generation, value)
            return value

    @staticmethod
    def _dicts(cur: sqlite3.Cursor) -> list[dict]:
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]


def iter_rows(index: TapeIndex, flt: Filters, sort: str, batch: int = 500) -> Iterator[dict]:
    """All rows of a filtered list, in pages (for scripts and tests)."""
    offset = 0
    while True:
        rows = index.page(flt, sort, offset, batch)
        if not rows:
            return
        yield from rows
        offset += len(rows)



"""Which training problems an iteration samples: a seeded order over the pool, and a curriculum.

Without a curriculum (`revisit_share: 0`) an iteration takes the next k problems of an endless
seeded order over the training pool: every problem once per pass, a new shuffle each pass.

With `revisit_share: s`, up to round(s·k) of the k are drawn again from earlier problems whose
last pass rate was strictly between 0 and 1: the only ones whose group advantages are not all 0,
so the only ones a policy-gradient step learns from. The rest come from the order as before.
The draw is a function of (seed, iteration, the table of pass rates before the iteration), so a
rerun or a resumed run draws the same problems.

The table lives in RUN/pass_rates.jsonl, one line per problem ever sampled:
    {"problem_id", "attempts", "successes", "pass_rate", "last_iteration", "last_pass_rate",
     "iterations": [[iteration, successes, attempts], ...]}
The loop's record phase rewrites it atomically; the entry of an iteration replaces any earlier
one of the same iteration, so a redone record phase counts nothing twice.
"""

from __future__ import annotations

import random
from pathlib import Path

from gsm8kctl.artifacts.jsonl import read_jsonl, write_jsonl


def problem_order(pool: int | list[int], seed: int, epoch: int) -> list[int]:
    """A seeded permutation of the training problems (their lines in the train file; an int n
    stands for all n lines), a new one each pass over them."""
    order = list(range(pool)) if isinstance(pool, int) else list(pool)
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def next_problems(cursor: int, k: int, pool: int | list[int], seed: int,
                  exclude: frozenset[str] = frozenset()) -> tuple[list[str], int]:
    """k distinct train problem ids from position `cursor` of the endless seeded order over
    `pool` (problem_order), and the position after them. Where a draw crosses into the next
    pass, an id the draw already holds is skipped: otherwise its attempts would be counted once
    and the iteration would be short (4032 of 4096 attempts at the first pass boundary of an
    H200 run). Ids in `exclude` (already drawn by the curriculum) are skipped the same way."""
    n_train = pool if isinstance(pool, int) else len(pool)
    ids, seen, orders, pos = [], set(exclude), {}, cursor
    while len(ids) < min(k, n_train - len(exclude)):
        epoch, offset = divmod(pos, n_train)
        if epoch not in orders:
            orders[epoch] = problem_order(pool, seed, epoch)
        pid = f"train-{orders[epoch][offset]:05d}"
        if pid not in seen:
            seen.add(pid)
            ids.append(pid)
        pos += 1
    return ids, pos


def choose_problems(cursor: int, k: int, pool: int | list[int], seed: int, iteration: int,
                    table: dict[str, dict], revisit_share: float) -> tuple[list[str], int, int]:
    """The iteration's k problems: (ids, the cursor after them, how many are revisits)."""
    open_ = sorted(pid for pid, row in table.items()
                   if row["last_iteration"] < iteration and 0 < row["last_pass_rate"] < 1)
    quota = min(round(revisit_share * k), len(open_))
    revisits = random.Random(f"{seed}:revisit:{iteration}").sample(open_, quota) if quota else []
    fresh, cursor = next_problems(cursor, k - quota, pool, seed, exclude=frozenset(revisits))
    return revisits + fresh, cursor, quota


def read_pass_rates(path: Path) -> dict[str, dict]:
    return {row["problem_id"]: row for row in read_jsonl(path)} if path.exists() else {}


def record_pass_rates(path: Path, iteration: int, tapes: list[dict],
                      table: dict[str, dict] | None = None) -> dict[str, dict]:
    """Put one iteration's outcomes (a tape's `correct`) into the table and rewrite it atomically.
    `table` is the file's content already held in memory (the loop keeps it between iterations),
    updated in place; None reads the file."""
    table = read_pass_rates(path) if table is None else table
    counts: dict[str, list[int]] = {}
    for t in tapes:
        c = counts.setdefault(t["problem_id"], [0, 0])
        c[0] += bool(t["correct"])
        c[1] += 1
    for pid, (ok, n) in counts.items():
        old = table.get(pid, {}).get("iterations", [])
        history = sorted([h for h in old if h[0] != iteration] + [[iteration, ok, n]])
        table[pid] = _row(pid, history)
    write_jsonl(path, [table[pid] for pid in sorted(table)])
    return table


def _row(pid: str, history: list[list[int]]) -> dict:
    ok, n = sum(h[1] for h in history), sum(h[2] for h in history)
    last = history[-1]
    return {"problem_id": pid, "attempts": n, "successes": ok, "pass_rate": round(ok / n, 4),
            "last_iteration": last[0], "last_pass_rate": round(last[1] / last[2], 4), "iterations": history}

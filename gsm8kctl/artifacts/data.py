"""GSM8k problems with stable ids (`train-00042`), from a local directory or the hub (`datasets`).

Three splits for a run: `test` is GSM8k's test file; `validation` is `validation_problems` problems
of GSM8k's train file held out by `seed`; `train` is the rest of the train file. The held-out
problems are never sampled for training, never in a warm start or an SFT control, and never
few-shot examples; the loop chooses its best checkpoint on them, so the test split chooses
nothing. An id names its file and line (`train-00042`), whichever split holds it.
"""

from __future__ import annotations

import os
import random
import re
from functools import lru_cache
from pathlib import Path

from gsm8kctl.agent import parse_gold
from gsm8kctl.artifacts.jsonl import read_jsonl_located, shown
from gsm8kctl.errors import UserError

FILES = ("train", "test")  # GSM8k's own files
SPLITS = ("train", "validation", "test")  # a run's splits: validation is held out of the train file
HUB_DATASET = ("openai/gsm8k", "main")
# A gold answer as parse_gold returns it (commas removed): every GSM8k gold is an integer; the
# grader compares numbers, so a word ('seventy-two') could never be matched.
_GOLD_NUMBER = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)")


def data_dir_from(explicit: str | None) -> Path | None:
    """--data-dir, else $GSM8K_DIR, else None (= the hub)."""
    d = explicit or os.environ.get("GSM8K_DIR")
    return Path(d) if d else None


@lru_cache(maxsize=8)
def _load_split(split: str, data_dir: str | None) -> tuple[dict, ...]:
    if split not in FILES:
        raise UserError(f"unknown split '{split}'; choose train or test")
    if data_dir is not None:
        path = Path(data_dir) / f"{split}.jsonl"
        if not path.exists():
            raise UserError(f"{path}: no such file (--data-dir / GSM8K_DIR must hold train.jsonl and test.jsonl)")
        rows = _read_local(path)
    else:
        rows = _read_hub(split)
    return tuple({
        "id": f"{split}-{i:05d}",
        "split": split,
        "question": row["question"],
        "solution": row["answer"],
        "gold": parse_gold(row["answer"]),
    } for i, row in enumerate(rows))


def _read_local(path: Path) -> list[dict]:
    """openai/grade-school-math JSONL, checked line by line so a bad line is named `file:line`.

    Read directly rather than through `datasets`: 7.5k lines parse in ~50 ms, and `datasets`
    would report a broken line without its number (and is not installed everywhere we run).
    """
    rows = []
    for where, row in read_jsonl_located(path):
        missing = [k for k in ("question", "answer") if k not in row]
        if missing:
            raise UserError(f"{where}: expected an object with 'question' and 'answer' (missing {', '.join(missing)})")
        for key in ("question", "answer"):
            if not isinstance(row[key], str) or not row[key].strip():
                raise UserError(f"{where}: {key} must be a non-empty string, got {shown(row[key])}")
        if "####" not in row["answer"]:
            raise UserError(f"{where}: answer has no '#### N' final line")
        gold = parse_gold(row["answer"])
        if not _GOLD_NUMBER.fullmatch(gold):
            raise UserError(f"{where}: answer: the gold after '####' must be a number, got {shown(gold)}")
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: no problems in it (expected one JSON object per line)")
    return rows


def _read_hub(split: str) -> list[dict]:
    try:
        import datasets

        datasets.disable_progress_bars()
        return list(datasets.load_dataset(*HUB_DATASET, split=split))
    except Exception as exc:  # offline, hub down, datasets missing: say what to do instead
        raise UserError(f"could not load {HUB_DATASET[0]} from the hub ({type(exc).__name__}); "
                        "set GSM8K_DIR or --data-dir to a directory with train.jsonl/test.jsonl") from None


def load_problems(split: str, data_dir: str | None = None) -> list[dict]:
    d = data_dir_from(data_dir)
    return list(_load_split(split, str(d) if d else None))


def select_problems(problems: list[dict], *, n_problems: int | None = None,
                    problem_ids: list[str] | None = None) -> list[dict]:
    """Pick by explicit ids (in the order given) or the first N; an empty pick is an error."""
    if problem_ids:
        by_id = {p["id"]: p for p in problems}
        missing = [pid for pid in problem_ids if pid not in by_id]
        if missing:
            raise UserError(f"unknown problem id(s): {', '.join(missing[:5])}")
        chosen = [by_id[pid] for pid in problem_ids]
    elif n_problems is not None:
        if n_problems <= 0:
            raise UserError("--n-problems must be positive")
        chosen = problems[:n_problems]
    else:
        chosen = list(problems)
    if not chosen:
        raise UserError("no problems selected")
    return chosen


def validation_indices(n_train: int, seed: int, n: int) -> frozenset[int]:
    """Lines of the train file held out for validation: `n` of them, fixed by `seed`."""
    if n <= 0:
        return frozenset()
    if n >= n_train:
        raise UserError(f"validation_problems={n} would hold out all {n_train} train problems; "
                        f"give fewer (0 = no validation split)")
    return frozenset(random.Random(f"{seed}:validation").sample(range(n_train), n))


def split_problems(cfg: dict, split: str) -> list[dict]:
    """The problems of a run's split (module docstring), in file order."""
    if split not in SPLITS:
        raise UserError(f"unknown split '{split}'; choose {', '.join(SPLITS)}")
    if split == "test":
        return load_problems("test", cfg["data_dir"])
    train = load_problems("train", cfg["data_dir"])
    held = validation_indices(len(train), cfg["seed"], cfg["validation_problems"])
    want = split == "validation"
    return [p for i, p in enumerate(train) if (i in held) == want]


def problems_by_id(cfg: dict, split: str, *, n_problems: int | None = None,
                   problem_ids: list[str] | None = None) -> list[dict]:
    """What a stage's --split/--n-problems/--problem-ids pick: the first N of the split, or the
    ids given, looked up in the file the split comes from (an id is a line of a file: the loop
    names its training problems by id, and a user may name a held-out one on purpose)."""
    if problem_ids:
        if split not in SPLITS:
            raise UserError(f"unknown split '{split}'; choose {', '.join(SPLITS)}")
        return select_problems(load_problems("test" if split == "test" else "train", cfg["data_dir"]),
                               problem_ids=problem_ids)
    return select_problems(split_problems(cfg, split), n_problems=n_problems)

"""Output paths checked before any stage opens anything for writing.

Every stage calls `check_output_file` / `check_output_dir` first, so a refused run writes
nothing: no output file, no config next to it, no directory. The checks refuse an output that
would destroy an input (the same file after symlinks and hard links: compared by st_dev/st_ino
when both exist), a GSM8k data file, a place this user cannot write, or an existing file that a
stage would replace but did not write (`check_replaceable`), with one line that names the path.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from gsm8kctl.errors import UserError

DATA_FILES = ("train.jsonl", "test.jsonl")


def same_file(a: str | Path, b: str | Path) -> bool:
    """True when `a` and `b` are one file: the same inode if both exist, else the same real path."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def is_inside(path: str | Path, directory: str | Path) -> bool:
    """True when `path` (resolved) lies somewhere under `directory` (resolved)."""
    return Path(directory).resolve() in Path(path).resolve().parents


def data_files(data_dir: str | None) -> list[Path]:
    """The GSM8k files a stage reads (--data-dir / $GSM8K_DIR); none when they come from the hub."""
    from gsm8kctl.artifacts.data import data_dir_from

    d = data_dir_from(data_dir)
    return [d / name for name in DATA_FILES] if d else []


def _first_existing(p: Path) -> Path:
    q = p
    while not os.path.lexists(q) and q != q.parent:
        q = q.parent
    return q


def check_creatable(path: str | Path, option: str) -> None:
    """`path` can be created (or replaced) here: its first existing ancestor is a writable directory."""
    p = Path(os.path.abspath(path))
    parent = _first_existing(p.parent)
    if not parent.is_dir():
        raise UserError(f"{path}: cannot create {option} here: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{path}: cannot write {option} here: {parent} is not writable (permission denied)")


def _refuse_clobber(p: Path, option: str, inputs: Iterable[str | Path], data_dir: str | None) -> None:
    for src in inputs:
        if str(src) != "-" and same_file(p, src):
            raise UserError(f"{p}: {option} is the input file {src}; writing it would destroy the input "
                            "(choose another output path)")
    for data in data_files(data_dir):
        if same_file(p, data):
            raise UserError(f"{p}: {option} is the GSM8k data file {data}; choose another output path")


def check_output_file(path: str | Path, *, option: str = "-o", inputs: Iterable[str | Path] = (),
                      data_dir: str | None = None, append: bool = False) -> None:
    """Refuse a file output that is a directory, unwritable, an input or a GSM8k data file.

    `append` outputs (sample's tapes) must be writable themselves; atomically replaced ones only
    need a writable directory. `-` (stdout) is always fine.
    """
    if str(path) == "-":
        return
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{p}: {option} is a directory; it takes a file path")
    if os.path.lexists(p) and not p.exists():
        raise UserError(f"{p}: {option} is a broken symbolic link")
    _refuse_clobber(p, option, inputs, data_dir)
    check_creatable(p, option)
    if append and p.exists() and not os.access(p, os.W_OK):
        raise UserError(f"{p}: {option} is not writable (permission denied)")


def check_output_dir(path: str | Path, *, option: str = "-o", files: Iterable[str] = (),
                     inputs: Iterable[str | Path] = (), data_dir: str | None = None) -> None:
    """Refuse a directory output that is a file or unwritable, or whose `files` would clobber an input."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{p}: {option} exists and is not a directory")
    if os.path.lexists(p) and not p.exists():
        raise UserError(f"{p}: {option} is a broken symbolic link")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise UserError(f"{p}: {option} is not writable (permission denied)")
    else:
        check_creatable(p, option)
    inputs = list(inputs)
    for name in files:
        f = p / name
        if f.is_dir():
            raise UserError(f"{f}: is a directory, but {option} writes a file there")
        _refuse_clobber(f, option, inputs, data_dir)


@dataclass(frozen=True)
class OwnFile:
    """A kind of file a stage writes whole: how to recognise one, and what to call it in an error."""
    looks_ours: Callable[[Path], bool]
    what: str


def check_replaceable(path: str | Path, *, option: str, kind: OwnFile) -> None:
    """An existing file that an output replaces whole must be one a stage wrote (`kind`): a rerun
    replaces its own output, but a user's file that happens to sit there is refused.

    Empty files and what is not a regular file (`/dev/null`) are fine to write into.
    """
    p = Path(path)
    if str(path) == "-" or not p.is_file() or p.stat().st_size == 0:
        return
    try:
        ours = kind.looks_ours(p)
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON/YAML: not ours either
        ours = False
    if not ours:
        raise UserError(f"{p}: {option} would replace this file, which is not {kind.what}; move it away or "
                        "choose another path")


def _first_line_is_json_object(p: Path) -> bool:
    with open(p, "rb") as f:
        line = f.readline(64 << 20)
    return isinstance(json.loads(line), dict)


def _is_saved_config(p: Path) -> bool:
    import yaml

    try:
        cfg = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return False
    return isinstance(cfg, dict) and {"model", "sampling", "finetune"} <= set(cfg)


# What filter and gather-tapes write: JSONL records (a user's text or JSON list is not).
JSONL_RECORDS = OwnFile(_first_line_is_json_object, "a JSONL file of records")
# What save_config writes: a YAML mapping with the config's main sections.
SAVED_CONFIG = OwnFile(_is_saved_config, "a config a stage saved")

"""A module of this repository as it is at a git revision, for benchmarks that time old against new
side by side in one process (`--against REV`)."""

from __future__ import annotations

import importlib.util
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def module_at(rev: str, relpath: str):
    """`relpath` (e.g. gsm8kctl/artifacts/jsonl.py) at git revision `rev`, loaded as a module of its own name."""
    source = subprocess.run(["git", "show", f"{rev}:{relpath}"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    name = Path(relpath).stem + "_at_rev"
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

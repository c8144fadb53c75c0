"""One sampling phase spread over N sampler processes, one per GPU: split, run, merge.

The loop's processes engine uses this when `sampling.num_processes > 1`. Shard k of N takes
problems k, k+N, k+2N, ... of the phase's problem list and runs the `sample` or `evaluate`
stage on them in its own process, on GPU k (`CUDA_VISIBLE_DEVICES=k`, when there is CUDA),
writing its own tapes file and its own call log under the phase's `shards/` directory. The N
processes run under one supervisor (`procs.py`): when one fails the others are stopped, and
when the loop dies they all die.

Then the loop merges, as the one writer of each artifact:
- the tapes of every shard (and any already in the phase's tapes file) into that one file, in
  the phase's problem order, then attempt, deduplicated by tape id, by an atomic rewrite;
- the calls of every shard into the run's call log, inserted with replace by call id.
A rerun after a crash resumes each shard from its own files and merges again, which changes
nothing that was merged already. Tape ids and seeds do not depend on the shard, so the tapes
are those one process would write (token for token where the kernels give the same logits).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from gsm8kctl.artifacts.jsonl import read_jsonl, write_jsonl
from gsm8kctl.procs import start_child



def split(ids: list[str], n: int) -> list[list[str]]:
    """Every n-th id from k, for k < n; empty shards are dropped."""
    return [part for part in (ids[k::n] for k in range(n)) if part]


def merge(tapes_file: Path, shard_tapes: list[Path], calls_db: Path, shard_calls: list[Path],
          problem_ids: list[str]) -> int:
    """Merge the shards' tapes into `tapes_file` and their calls into `calls_db`; tapes in the file."""
    from gsm8kctl.artifacts import llm_calls

    rank = {pid: i for i, pid in enumerate(problem_ids)}
    by_id: dict[str, dict] = {}
    for path in [tapes_file, *shard_tapes]:
        if path.exists():
            # A shard killed mid-line left a half line: dropped here, redone by the shard's rerun.
            for t in read_jsonl(path, repair_tail=path != tapes_file):
                by_id.setdefault(t["id"], t)
    tapes = sorted(by_id.values(), key=lambda t: (rank.get(t["problem_id"], len(rank)), t["problem_id"],
                                                  t.get("iteration") or 0, t["attempt"], t["id"]))
    db = llm_calls.open_log(calls_db)
    try:
        for part in shard_calls:
            if part.exists():
                conn = llm_calls.open_readonly(part)
                try:
                    rows = [dict(r) for r in conn.execute(f"SELECT * FROM {llm_calls.TABLE}")]
                finally:
                    conn.close()
                llm_calls.insert_calls(db, rows)  # calls before tapes: a tape never points at a missing call
    finally:
        db.close()
    write_jsonl(tapes_file, tapes)
    return len(tapes)


def shard_env(k: int) -> dict:
    """Shard k's environment: its own GPU when there are GPUs."""
    import torch

    return {"CUDA_VISIBLE_DEVICES": str(k)} if torch.cuda.is_available() else {}


def main(argv: list[str]) -> int:
    """Run the stage commands of a spec file side by side; stop all when one fails."""
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    procs = [start_child([sys.executable, "-m", "gsm8kctl", *args], env={**os.environ, **env})
             for args, env in zip(spec["commands"], spec["envs"])]
    failed = 0
    while any(p.poll() is None for p in procs):
        bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if bad:
            failed = bad[0]
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait()
            break
        time.sleep(0.2)
    codes = [p.wait() for p in procs]
    return failed or next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

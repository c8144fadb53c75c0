"""Benchmark the tape browser on a large run: 100 000 tapes in one file + 100 000 LLM calls.

Builds the data in a temp dir (or --dir), starts `browse` as a real server process on a free
127.0.0.1 port, and times over HTTP: startup + indexing, the first page of the list, filtered
lists (outcome, text search, a deep page of a sorted filter), one tape, pages of calls (the
second and a deep one), one call, the summary; then reads the server's RSS (now and peak).
Prints a table on stderr and writes JSON with --out.

    .venv/bin/python bench/bench_browse.py --out bench_browse.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the fixture generator the tests use

from browse_fixtures import OUTCOME_CYCLE, call_for, fake_tape  # noqa: E402

TARGET_S = 1.0


def build(run: Path, n_tapes: int, n_calls: int, attempts: int = 8) -> dict:
    from gsm8kctl.artifacts.llm_calls import insert_calls, open_log

    rng = random.Random(0)
    tapes_file = run / "iterations" / "0000" / "tapes.jsonl"
    tapes_file.parent.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text("model: smollm2-135m\n")
    # Token arrays dominate a tape's bytes; generating 100k x 400 random ints in Python is slow,
    # so tapes draw from a pool of realistic arrays (sizes as SmolLM2 on GSM8k: ~150 prompt,
    # ~250 completion tokens).
    pool = [fake_tape(iteration=0, split="train", problem_index=i, attempt=0, outcome=OUTCOME_CYCLE[i % 8],
                      rng=rng, n_completion_tokens=rng.randint(120, 420)) for i in range(64)]
    t0 = time.perf_counter()
    ids = []
    with open(tapes_file, "w", encoding="utf-8") as f:
        for i in range(n_tapes):
            p, a = divmod(i, attempts)
            outcome = OUTCOME_CYCLE[(p * 3 + a) % len(OUTCOME_CYCLE)]
            tape = fake_tape(iteration=0, split="train", problem_index=p, attempt=a, outcome=outcome, rng=rng,
                             n_completion_tokens=1, created=1.7e9 + i)
            src = pool[i % len(pool)]
            tape["prompt_token_ids"] = src["prompt_token_ids"]
            tape["completion_token_ids"] = src["completion_token_ids"]
            tape["logprobs"] = src["logprobs"]
            ids.append(tape["id"])
            f.write(json.dumps(tape, ensure_ascii=False, separators=(",", ":")) + "\n")
    tapes_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    db = open_log(run / "llm_calls.sqlite")
    batch = []
    rng = random.Random(1)
    for i in range(n_calls):
        tape = {"id": ids[i % len(ids)], "question": "q", "model": "smollm2-135m", "finish_reason": "stop",
                "steps": [{}, {"text": pool[i % len(pool)]["steps"][1]["text"], "llm_call_id": f"call-{i:07d}"}],
                "prompt_token_ids": pool[0]["prompt_token_ids"],
                "completion_token_ids": pool[0]["completion_token_ids"]}
        batch.append(call_for(tape, i, 1.7e9 + i + rng.random()))
        if len(batch) == 5000:
            insert_calls(db, batch)
            batch = []
    insert_calls(db, batch)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.conn.close()
    calls_s = time.perf_counter() - t0
    return {"tapes_file": str(tapes_file), "tapes_file_mb": round(tapes_file.stat().st_size / 2**20, 1),
            "calls_db_mb": round((run / "llm_calls.sqlite").stat().st_size / 2**20, 1),
            "ids": ids, "build_tapes_s": round(tapes_s, 1), "build_calls_s": round(calls_s, 1)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> tuple[float, float]:
    """(current RSS, peak RSS) in MiB from /proc."""
    cur = peak = 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return round(cur, 1), round(peak, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tapes", type=int, default=100_000)
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5, help="timed requests per URL (first + median reported)")
    ap.add_argument("--dir", help="build the data here and keep it (default: a temp dir, removed)")
    ap.add_argument("--out", help="write the results as JSON to this file")
    args = ap.parse_args()

    import httpx

    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_browse."))
    run = workdir / "run"
    server = None
    try:
        if not (run / "llm_calls.sqlite").exists():
            print(f"building {args.tapes} tapes + {args.calls} calls in {run} ...", file=sys.stderr)
            data = build(run, args.tapes, args.calls)
        else:
            ids = [json.loads(line)["id"] for line in open(run / "iterations" / "0000" / "tapes.jsonl")]
            data = {"ids": ids, "tapes_file_mb": None, "calls_db_mb": None}
        port = free_port()
        code = f"from gsm8kctl.stages.browse import browse; browse({str(run)!r}, port={port})"
        t0 = time.perf_counter()
        server = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        base = f"http://127.0.0.1:{port}"
        client = httpx.Client(base_url=base, timeout=120)
        while True:
            if server.poll() is not None:
                raise SystemExit(f"server exited: {server.stderr.read()}")
            try:
                if client.get("/static/browse.css").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        startup_s = time.perf_counter() - t0

        mid = data["ids"][len(data["ids"]) // 2]
        urls = [
            ("list: first page", "/"),
            ("list: outcome=wrong", "/?outcome=wrong"),
            ("list: text search", "/?q=recompute+this"),
            ("list: wrong, longest first, page 200", "/?outcome=wrong&sort=-length&page=200"),
            ("tape", f"/tapes/{mid}"),
            ("tape in filtered list", f"/tapes/{mid}?outcome=wrong&sort=-reward"),
            ("calls: page 2", "/calls?page=2"),
            ("calls: page 900", "/calls?page=900"),
            ("call", "/calls/call-0050000"),
            ("summary", "/summary"),
        ]
        results = []
        for label, url in urls:
            times = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                r = client.get(url)
                times.append(time.perf_counter() - t)
                if r.status_code != 200:
                    raise SystemExit(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
            results.append({"what": label, "url": url, "first_s": round(times[0], 4),
                            "median_s": round(statistics.median(times), 4), "bytes": len(r.content),
                            "ok": times[0] < TARGET_S})
        cur, peak = rss_mb(server.pid)
        report = {
            "tapes": len(data["ids"]), "calls": args.calls, "tapes_file_mb": data.get("tapes_file_mb"),
            "calls_db_mb": data.get("calls_db_mb"), "startup_and_index_s": round(startup_s, 2),
            "requests": results, "server_rss_mb": cur, "server_peak_rss_mb": peak,
            "cpu": os.cpu_count(), "python": sys.version.split()[0],
        }
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"browse: {report['tapes']:,} tapes ({report['tapes_file_mb']} MiB), "
                        f"{report['calls']:,} calls ({report['calls_db_mb']} MiB)")
    for col in ("what", "first s", "median s", f"< {TARGET_S:g} s"):
        table.add_column(col, justify="left" if col == "what" else "right")
    table.add_row("server start + index", f"{report['startup_and_index_s']:.2f}", "", "")
    for r in results:
        table.add_row(r["what"], f"{r['first_s']:.3f}", f"{r['median_s']:.3f}", "yes" if r["ok"] else "NO")
    table.add_row("server RSS now / peak (MiB)", f"{report['server_rss_mb']}", f"{report['server_peak_rss_mb']}", "")
    Console(stderr=True).print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

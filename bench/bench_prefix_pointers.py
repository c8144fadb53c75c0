"""The host's share of split-K's shared prompt reads (backends/slots.py, `SlotEngine._repoint`).

After each admission and compaction, the slot engine points every busy row at the lowest busy
row of its group (the rows admitted with the same prompt), and copies the pointers to the device
when they changed. This times that bookkeeping alone, on the CPU, with every row busy in groups of
16 and one row's group changed before each call (so the copy runs each time), at several slot
counts; median of `--repeats` calls. A random-init 2-layer model holds the engine (no weights are
read). Prints a table and writes JSON.

    python bench/bench_prefix_pointers.py --slots 432,1024,2368 --out prefix-pointers.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gsm8kctl.sampling.backends.slots import SlotEngine

    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", default="432,1024,2368")
    ap.add_argument("--group", type=int, default=16, help="rows per prompt")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default="prefix-pointers.json")
    a = ap.parse_args()
    try:
        slot_counts = [int(s) for s in a.slots.split(",")]
    except ValueError:
        ap.error(f"--slots: comma-separated integers, not {a.slots!r}")
    if min(slot_counts) < 1 or a.group < 1 or a.repeats < 1:
        ap.error("--slots, --group and --repeats must be >= 1")
    cfg = LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).eval()
    rows = []
    for slots in slot_counts:
        engine = SlotEngine(model, slots=slots, max_len=128, stop_ids=[0], pad_id=0, attention="sdpa")
        engine.share_prefix = True  # the bookkeeping as split-K runs it; the CPU has no split-K
        owner = [object()] * slots  # every row busy
        engine._group = [r // a.group for r in range(slots)]
        seconds = []
        for i in range(a.repeats):
            engine._group[i % slots] = -1 - i  # a row in a group of its own: the pointers change
            t0 = time.perf_counter()
            engine._repoint(owner)
            seconds.append(time.perf_counter() - t0)
        rows.append({"slots": slots, "group": a.group, "median_us": round(statistics.median(seconds) * 1e6, 1)})
    print("| slots | rows per prompt | one re-pointing, median |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['slots']} | {r['group']} | {r['median_us']} µs |")
    Path(a.out).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

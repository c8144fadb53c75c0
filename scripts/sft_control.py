"""The SFT-only control: keep training on gold solutions, token for token as an RL run.

    python scripts/sft_control.py runs/sft-control --like runs/rejection

RL must beat this baseline. Starting from the same checkpoint as the RL run (`--init`, default:
the RL run's warm-start checkpoint, the one its first iteration sampled with), this trains on
gold solutions of the train split (`filter --gold`, the sampler's own prompt format) for as
many completion tokens as the RL run trained up to each of its iterations (from its
finetune/metrics.jsonl), and evaluates wherever the RL run evaluated, with the same
`eval_limit`. It writes OUT/metrics.jsonl with the loop's keys (iteration, model, test strict
and lenient, seconds) plus the optimizer steps and the token target it trained to, so
`scripts/results_report.py` puts it beside the RL runs.

It runs on the loop's in-process engine (`gsm8kctl/engine.py`): one trainer and one sampler for
the whole control, no process per phase. Rerun the same command after a crash: finetune
continues from its last checkpoint and evaluate appends only missing problems.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from gsm8kctl.stages.control import rl_token_schedule  # noqa: E402 - after the sys.path line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="run directory of the control (created; rerun to resume)")
    ap.add_argument("--like", type=Path, required=True, help="the RL run to match")
    ap.add_argument("--init", help="start checkpoint (default: the RL run's first sampling model)")
    ap.add_argument("--config", type=Path, help="YAML config (default: the RL run's config.yaml)")
    ap.add_argument("--gold-problems", type=int, help="gold solutions of the first N train problems (default: all)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_intermixed_args()  # overrides may follow the options

    from gsm8kctl.config import load_config, save_config, set_value
    from gsm8kctl.engine import InProcessEngine
    from gsm8kctl.jsonl import read_jsonl, write_jsonl
    from gsm8kctl.rundir import RUN_METRICS_FILE, eval_dir, latest_checkpoint
    from gsm8kctl.tapes import METRICS_FILE

    cfg = load_config(args.config or args.like / "config.yaml", args.overrides)
    rows, cumulative = rl_token_schedule(args.like)
    init = args.init or next((r["model"] for r in rows if r.get("attempts")), cfg["model"])
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    gold = out / "gold_samples.jsonl"
    engine = InProcessEngine(cfg, out, quiet=False)
    try:
        if not gold.exists():
            engine.gold_samples(gold, args.gold_problems)  # in the sampler's own prompt format
        if latest_checkpoint(out) is None:
            set_value(cfg, "model", init)  # where the trainer starts (no checkpoint in OUT yet)
            engine.cfg = cfg
        save_config(cfg, out / "config.yaml")
        samples = list(read_jsonl(gold))
        per_step = (cfg["finetune"]["train_batch_size"] * cfg["finetune"]["gradient_accumulation_passes"]
                    * sum(len(s["input_ids"]) - s["prompt_len"] for s in samples) / len(samples))
        path = out / RUN_METRICS_FILE
        done = {r["iteration"]: r for r in read_jsonl(path)} if path.exists() else {}
        for r in rows:
            it = r["iteration"]
            if it in done:
                continue
            row: dict = {"iteration": it, "seconds": {}}
            steps = math.ceil(cumulative.get(it - 1, 0) / per_step) if it > 0 else 0
            if steps:  # the tokens the RL run had trained before this iteration's evaluation
                t0 = time.time()
                info = engine.finetune(gold, steps, objective="sft")
                # On disk before it is named and evaluated: this script resumes from disk alone.
                engine.wait_saved()
                row["seconds"]["finetune"] = round(time.time() - t0, 1)
                row.update(train_steps_total=steps, train_tokens_target=cumulative[it - 1])
                if info.get("refresh_s") is not None:
                    row["seconds"]["weights_refresh"] = info["refresh_s"]
            model = str(latest_checkpoint(out) or init)
            row["model"] = model
            if r.get("test_accuracy_strict") is not None:
                t0 = time.time()
                engine.evaluate(model, eval_dir(out, it), it, cfg["eval_limit"])
                row["seconds"]["evaluate"] = round(time.time() - t0, 1)
                m = json.loads((eval_dir(out, it) / METRICS_FILE).read_text(encoding="utf-8"))
                row.update(test_accuracy_strict=m["accuracy_strict"], test_accuracy_lenient=m["accuracy_lenient"],
                           test_format_rate=m["format_rate"], test_n=m["n"])
            done[it] = row
            write_jsonl(path, [done[k] for k in sorted(done)])  # atomic: a rerun redoes only what is missing
            print(json.dumps(row), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# A loop whose GPU memory is taken from under it by another program, from the repository root
# on a machine with a CUDA GPU:
#     source bench/gpu/prepare.sh && bash bench/gpu/squeeze.sh start DIR
#     bash bench/gpu/squeeze.sh poll DIR [SECONDS]   # progress every 30 s; then packs DIR's results
# `start` copies the package and the GSM8k data to DIR/app, then runs, detached (setsid):
#   1. gsm8kctl loop --run-dir DIR/loop model=MODEL $EXTRA, the default config alone on the GPU;
#   2. once DIR/loop/metrics.jsonl holds iteration AFTER, another process that takes all but LEAVE
#      GiB of the GPU's free memory (one tensor) and holds it until the loop exits;
#   3. if the loop exited non-zero: that process is stopped and the same loop command is run again,
#      which resumes where the first stopped.
# DIR/squeeze.out has every line of both loop runs; DIR/squeeze.json the exit codes, the memory
# taken, and each iteration's out-of-memory retries (the `warnings` of metrics.jsonl).
# Reads: MODEL [$SMOLLM2]; GSM8K_DIR; PYTHON [python3]; AFTER [2]; LEAVE [4] (GiB);
# EXTRA, overrides for the loop [iterations=16].
set -u
cmd=${1:?start or poll} dir=${2:?the directory of the run}
PY=${PYTHON:-python3}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
if [ "$cmd" = start ]; then
  model=${MODEL:-${SMOLLM2:?set MODEL or SMOLLM2 to the model directory (or source bench/gpu/prepare.sh)}}
  : "${GSM8K_DIR:?set GSM8K_DIR to the GSM8k data directory}"
  after=${AFTER:-2} leave=${LEAVE:-4}
  [[ $after =~ ^[0-9]+$ ]] && [[ $leave =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "AFTER: an iteration, LEAVE: GiB" >&2; exit 2; }
  rm -rf "$dir/app" && mkdir -p "$dir/app" && cp -r gsm8kctl "$dir/app/" && cp -r "$GSM8K_DIR" "$dir/app/gsm8k"
  export PYTHONPATH=$dir/app${PYTHONPATH:+:$PYTHONPATH} GSM8K_DIR=$dir/app/gsm8k PYTHONUNBUFFERED=1
  cd "$dir/app"
  loop="$PY -m gsm8kctl loop --run-dir '$dir/loop' model=$model ${EXTRA:-iterations=16}"
  setsid bash -c "
    $loop >> '$dir/squeeze.out' 2>&1 & lp=\$!
    # Wait for iteration $after to be recorded, or for the loop to end first.
    until grep -q '\"iteration\": *$after[,}]' '$dir/loop/metrics.jsonl' 2>/dev/null || ! kill -0 \$lp 2>/dev/null; do sleep 1; done
    $PY - '$dir/hog.json' $leave \$lp <<'HOG' >> '$dir/squeeze.out' 2>&1 &
import json, os, sys, time
import torch
free, total = torch.cuda.mem_get_info()
take = max(0, free - int(float(sys.argv[2]) * 2**30))
held = torch.empty(take, dtype=torch.uint8, device='cuda')
json.dump({'free_before_gib': round(free / 2**30, 2), 'taken_gib': round(take / 2**30, 2),
           'left_gib': round(torch.cuda.mem_get_info()[0] / 2**30, 2)}, open(sys.argv[1], 'w'))
print(f'squeeze: took {take / 2**30:.1f} GiB of {free / 2**30:.1f} free', flush=True)
while os.path.exists(f'/proc/{sys.argv[3]}'):
    time.sleep(0.5)
HOG
    hog=\$!
    wait \$lp; echo \$? > '$dir/rc1'
    kill \$hog 2>/dev/null; wait \$hog 2>/dev/null
    if [ \"\$(cat '$dir/rc1')\" != 0 ]; then
      echo '=== squeeze: the loop stopped; the memory is given back; the same command again' >> '$dir/squeeze.out'
      $loop >> '$dir/squeeze.out' 2>&1; echo \$? > '$dir/rc2'
    fi
    touch '$dir/done'
  " < /dev/null > /dev/null 2>&1 &
  sleep 2; echo started; exit 0
fi
[ "$cmd" = poll ] || { echo "unknown command $cmd: start or poll" >&2; exit 2; }
end=$(( $(date +%s) + ${3:-60} ))
while :; do
  echo "== $(date -u +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"
  grep -E "squeeze|out of memory|Error" "$dir/squeeze.out" 2>/dev/null | tail -n 5 | cut -c1-300
  [ -f "$dir/loop/metrics.jsonl" ] && tail -n1 "$dir/loop/metrics.jsonl" | cut -c1-120
  [ -f "$dir/done" ] && break
  [ "$(date +%s)" -ge "$end" ] && break
  sleep 30
done
$PY - "$dir" <<'PY'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
rc = {n: int(p.read_text()) for n in ("rc1", "rc2") if (p := d / n).exists()}
rows = [json.loads(l) for l in open(d / "loop/metrics.jsonl")] if (d / "loop/metrics.jsonl").exists() else []
retries = {r["iteration"]: [w for w in r.get("warnings", []) if "memory" in w] for r in rows}
out = {"exit_codes": rc, "done": (d / "done").exists(),
       "hog": json.loads((d / "hog.json").read_text()) if (d / "hog.json").exists() else None,
       "last_iteration": rows[-1]["iteration"] if rows else None,
       "iterations_with_retries": {i: w for i, w in retries.items() if w}}
(d / "squeeze.json").write_text(json.dumps(out, indent=1))
print(json.dumps(out, indent=1)[:3000])
PY
results=${OUT:-$dir}/results.tgz
mkdir -p "$(dirname "$results")"
(cd "$dir" && tar czf "$results" --exclude='loop/checkpoints' --exclude='loop/iterations' --exclude='loop/eval' \
   --exclude='loop/validation' --exclude='loop/warmup' --exclude='*.sqlite' --exclude='app' \
   --exclude='loop/gold_samples.jsonl' loop squeeze.out squeeze.json 2>/dev/null)
ls -la "$results"

#!/usr/bin/env bash
# Recipes compared over seeds on one GPU (docs/results.md, "Recipes compared"), all at once, from
# the repository root on a machine with a CUDA GPU:
#     source bench/gpu/prepare.sh
#     bash bench/gpu/compare.sh start DIR SEEDS NAME 'OVERRIDES' [NAME 'OVERRIDES' ...]
#     bash bench/gpu/compare.sh poll DIR [SECONDS]   # progress every 60 s; then packs DIR's results
# Example: bash bench/gpu/compare.sh start runs/cmp 1,2,3 curriculum 'revisit_share=0.5' \
#              warm3 'warmup_sft_steps=327'
# `start` copies the package and the GSM8k data to DIR/app (editing this checkout cannot change the
# runs under way), then starts one `gsm8kctl seeds --seeds SEEDS --no-control` per NAME, detached
# (setsid), with its OVERRIDES and $COMMON after the model. Its run goes to DIR/NAME, its output to
# DIR/NAME.out, its exit code to DIR/NAME.rc. Each loop gets an equal share of the GPU's memory
# (gpu_memory_share = 1 / all loops started). Rerun `start` with the same arguments to resume.
# `poll` prints each seed's latest evaluations (test/validation strict) every 60 s until SECONDS
# (default 60) pass or every run is done, then writes the small results (metrics, state, configs,
# seeds.json; no checkpoints, tapes or evaluations) to $OUT/results.tgz [DIR/results.tgz].
# Reads: MODEL, the SmolLM2-135M-Instruct directory [$SMOLLM2]; GSM8K_DIR; PYTHON [python3];
# COMMON, overrides for every run (for example iterations=24).
set -u
cmd=${1:?start or poll} dir=${2:?the directory of the runs}
PY=${PYTHON:-python3}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
if [ "$cmd" = start ]; then
  seeds=${3:?comma-separated seeds}; shift 3
  [ $(( $# % 2 )) -eq 0 ] && [ $# -gt 0 ] || { echo "give NAME 'OVERRIDES' pairs" >&2; exit 2; }
  model=${MODEL:-${SMOLLM2:?set MODEL or SMOLLM2 to the model directory (or source bench/gpu/prepare.sh)}}
  : "${GSM8K_DIR:?set GSM8K_DIR to the GSM8k data directory}"
  n_seeds=$(echo "$seeds" | tr ',' '\n' | grep -c .)
  share=$($PY -c "print(round(1 / ($n_seeds * $# // 2), 4))")
  rm -rf "$dir/app" && mkdir -p "$dir/app" && cp -r gsm8kctl "$dir/app/" && cp -r "$GSM8K_DIR" "$dir/app/gsm8k"
  export PYTHONPATH=$dir/app${PYTHONPATH:+:$PYTHONPATH} GSM8K_DIR=$dir/app/gsm8k PYTHONUNBUFFERED=1
  cd "$dir/app"
  while [ $# -gt 0 ]; do
    name=$1 overrides=$2; shift 2
    setsid bash -c "$PY -m gsm8kctl seeds --no-control --run-dir '$dir/$name' --seeds $seeds model=$model gpu_memory_share=$share ${COMMON:-} $overrides > '$dir/$name.out' 2>&1; echo \$? > '$dir/$name.rc'" < /dev/null > /dev/null 2>&1 &
    echo "started $name: $overrides (gpu_memory_share=$share)"
  done
  sleep 2; exit 0
fi
[ "$cmd" = poll ] || { echo "unknown command $cmd: start or poll" >&2; exit 2; }
end=$(( $(date +%s) + ${3:-60} ))
while :; do
  echo "== $(date -u +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"
  for m in "$dir"/*/seed-*/metrics.jsonl; do
    [ -f "$m" ] && $PY -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1])]
ev=[r for r in rows if r.get('test_accuracy_strict') is not None]
last=rows[-1]
print('/'.join(sys.argv[1].split('/')[-3:-1]), 'it', last['iteration'], 'evals', ' '.join(f\"{r['iteration']}:{r['test_accuracy_strict']:.3f}/{r.get('validation_accuracy_strict') or 0:.3f}\" for r in ev[-6:]), 'succ', last.get('train_success_rate'), 'fill', (lambda c: c and f\"{c['mean_busy_rows']:.0f}/{c['slots']} in {c['decode_steps']} steps\")(next((r['sampler'] for r in reversed(rows) if r.get('sampler')), None)))" "$m"
  done
  n_out=$(ls "$dir"/*.out 2>/dev/null | wc -l) n_rc=$(ls "$dir"/*.rc 2>/dev/null | wc -l)
  ls "$dir"/*.rc 2>/dev/null | xargs -r tail -n1
  [ "$n_rc" -ge "$n_out" ] && [ "$n_out" -gt 0 ] && break
  [ "$(date +%s)" -ge "$end" ] && break
  sleep 60
done
for f in "$dir"/*.out; do tail -n 15 "$f" | grep -v "it/s\]" | cut -c1-300; done
results=${OUT:-$dir}/results.tgz
mkdir -p "$(dirname "$results")"
(cd "$dir" && tar czf "$results" --exclude='*/checkpoints' --exclude='*/iterations' --exclude='*/eval' \
   --exclude='*/validation' --exclude='*/warmup' --exclude='*.sqlite' --exclude='app' \
   --exclude='gold_samples.jsonl' --exclude='results.tgz' $(ls | grep -v '^app$\|results.tgz') 2>/dev/null)
ls -la "$results"

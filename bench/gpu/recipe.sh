#!/usr/bin/env bash
# The default recipe over seeds, and the headline command, side by side on one GPU (docs/results.md),
# from the repository root on a machine with a CUDA GPU:
#     source bench/gpu/prepare.sh && bash bench/gpu/recipe.sh start DIR [SEEDS]
#     bash bench/gpu/recipe.sh poll DIR [SECONDS]     # progress every 60 s; then packs DIR's results
# `start` copies the package and the GSM8k data to DIR/app (so editing or replacing this checkout
# cannot change the runs under way), then starts both commands detached (setsid), so they outlive
# this shell, and returns:
#   DIR/seeds     gsm8kctl seeds --seeds SEEDS (default 1,2,3): each a loop of the default config and its SFT control
#   DIR/a8        gsm8kctl loop --attempts 8 with nothing else (the README's first command)
# Their output goes to DIR/seeds.out and DIR/a8.out, their exit codes to DIR/seeds.rc and DIR/a8.rc.
# `poll` prints each run's latest evaluations every 60 s until SECONDS (default 60) pass or both are
# done, then writes the small results (metrics, state, configs, logs; no checkpoints, tapes or
# evaluations) to $OUT/results.tgz [DIR/results.tgz]. Rerun `start` on the same DIR to resume both.
# Reads: MODEL, the SmolLM2-135M-Instruct directory [$SMOLLM2]; GSM8K_DIR, the GSM8k data
# directory; PYTHON [python3]; EXTRA, key=value overrides appended to both commands; RUNS, which
# to start [seeds a8]: `seeds` alone gives each loop 1/R of the GPU (as `gsm8kctl seeds` plans it
# by itself), `a8` alone runs the headline command on the whole GPU, as a user would.
set -u
cmd=${1:?start or poll} dir=${2:?the directory of the runs}
PY=${PYTHON:-python3}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
if [ "$cmd" = start ]; then
  runs=" ${RUNS:-seeds a8} "
  for r in $runs; do [ "$r" = seeds ] || [ "$r" = a8 ] || { echo "RUNS: unknown run '$r' (seeds, a8)" >&2; exit 2; }; done
  model=${MODEL:-${SMOLLM2:?set MODEL or SMOLLM2 to the model directory (or source bench/gpu/prepare.sh)}}
  : "${GSM8K_DIR:?set GSM8K_DIR to the GSM8k data directory}"
  rm -rf "$dir/app" && mkdir -p "$dir/app" && cp -r gsm8kctl "$dir/app/" && cp -r "$GSM8K_DIR" "$dir/app/gsm8k"
  export PYTHONPATH=$dir/app${PYTHONPATH:+:$PYTHONPATH} GSM8K_DIR=$dir/app/gsm8k PYTHONUNBUFFERED=1
  cd "$dir/app"
  [[ $runs = *" seeds "* ]] && setsid bash -c "$PY -m gsm8kctl seeds --run-dir '$dir/seeds' --seeds ${3:-1,2,3} model=$model ${EXTRA:-} > '$dir/seeds.out' 2>&1; echo \$? > '$dir/seeds.rc'" < /dev/null > /dev/null 2>&1 &
  # Beside the seeds, whose loops each take 1/3 of the sampler's default KV share, this one the same.
  share=$([[ $runs = *" seeds "* ]] && echo sampling.kv_memory_fraction=0.1)
  [[ $runs = *" a8 "* ]] && setsid bash -c "$PY -m gsm8kctl loop --attempts 8 --run-dir '$dir/a8' model=$model $share ${EXTRA:-} > '$dir/a8.out' 2>&1; echo \$? > '$dir/a8.rc'" < /dev/null > /dev/null 2>&1 &
  sleep 2; echo started; exit 0
fi
[ "$cmd" = poll ] || { echo "unknown command $cmd: start or poll" >&2; exit 2; }
end=$(( $(date +%s) + ${3:-60} ))
while :; do
  echo "== $(date -u +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"
  for m in "$dir"/seeds/seed-*/metrics.jsonl "$dir"/a8/metrics.jsonl; do
    [ -f "$m" ] && $PY -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1])]
ev=[r for r in rows if r.get('test_accuracy_strict') is not None]
last=rows[-1]
print(sys.argv[1].split('/')[-2], 'it', last['iteration'], 'evals', ' '.join(f\"{r['iteration']}:{r['test_accuracy_strict']:.3f}/{r.get('validation_accuracy_strict') or 0:.3f}\" for r in ev[-6:]), 'succ', last.get('train_success_rate'), 'fill', (lambda c: c and f\"{c['mean_busy_rows']:.0f}/{c['slots']} in {c['decode_steps']} steps\")(next((r['sampler'] for r in reversed(rows) if r.get('sampler')), None)))" "$m"
  done
  ls "$dir"/*.rc 2>/dev/null | xargs -r tail -n1
  { [ -f "$dir/seeds.rc" ] || [ ! -f "$dir/seeds.out" ]; } && { [ -f "$dir/a8.rc" ] || [ ! -f "$dir/a8.out" ]; } && break
  [ "$(date +%s)" -ge "$end" ] && break
  sleep 60
done
tail -n 25 $(ls "$dir"/seeds.out "$dir"/a8.out 2>/dev/null) | grep -v "it/s\]" | cut -c1-400
results=${OUT:-$dir}/results.tgz
mkdir -p "$(dirname "$results")"
(cd "$dir" && tar czf "$results" --exclude='*/checkpoints' --exclude='*/iterations' --exclude='*/eval' \
   --exclude='*/validation' --exclude='*/warmup' --exclude='*.sqlite' --exclude='app' \
   --exclude='gold_samples.jsonl' --exclude='results.tgz' seeds a8 seeds.out a8.out 2>/dev/null)
ls -la "$results"

#!/usr/bin/env bash
# The default recipe over seeds, and the headline command, side by side on one GPU machine:
#     source bench/gpu/prepare.sh && bash bench/gpu/recipe.sh start DIR [SEEDS]
#     bash bench/gpu/recipe.sh poll DIR SECONDS        # waits, then packs DIR's results into $OUT
# `start` copies the package to DIR/app (so editing or replacing this checkout cannot change the
# runs under way), then starts, each in its own process session so it outlives this shell:
#   DIR/seeds     gsm8kctl seeds --seeds SEEDS (default 1,2,3): each a loop of the default config and its SFT control
#   DIR/a8        gsm8kctl loop --attempts 8 with nothing else (the README's first command)
# MODEL (default $SMOLLM2) is the model; EXTRA is appended to both commands.
set -u
cmd=$1 dir=$2
mkdir -p "$dir"
if [ "$cmd" = start ]; then
  rm -rf "$dir/app" && mkdir -p "$dir/app/.devdata" && cp -r gsm8kctl "$dir/app/" && cp -r .devdata/gsm8k "$dir/app/.devdata/"
  export PYTHONPATH=/tmp/site:$dir/app GSM8K_DIR=$dir/app/.devdata/gsm8k PYTHONUNBUFFERED=1
  model=${MODEL:-$SMOLLM2}
  cd "$dir/app"
  setsid bash -c "python3 -m gsm8kctl seeds --run-dir '$dir/seeds' --seeds ${3:-1,2,3} model=$model ${EXTRA:-} > '$dir/seeds.out' 2>&1; echo \$? > '$dir/seeds.rc'" < /dev/null > /dev/null 2>&1 &
  # The seeds' loops each take 1/3 of the sampler's default KV share; this one the same.
  setsid bash -c "python3 -m gsm8kctl loop --attempts 8 --run-dir '$dir/a8' model=$model sampling.kv_memory_fraction=0.1 ${EXTRA:-} > '$dir/a8.out' 2>&1; echo \$? > '$dir/a8.rc'" < /dev/null > /dev/null 2>&1 &
  sleep 2; echo started; exit 0
fi
# poll: report every 60 s until SECONDS pass or both are done, then pack the small results.
end=$(( $(date +%s) + ${3:-60} ))
while :; do
  echo "== $(date -u +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"
  for m in "$dir"/seeds/seed-*/metrics.jsonl "$dir"/a8/metrics.jsonl; do
    [ -f "$m" ] && python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1])]
ev=[r for r in rows if r.get('test_accuracy_strict') is not None]
last=rows[-1]
print(sys.argv[1].split('/')[-2], 'it', last['iteration'], 'evals', ' '.join(f\"{r['iteration']}:{r['test_accuracy_strict']:.3f}/{r.get('validation_accuracy_strict') or 0:.3f}\" for r in ev[-6:]), 'succ', last.get('train_success_rate'))" "$m"
  done
  ls "$dir"/*.rc 2>/dev/null | xargs -r tail -n1
  [ -f "$dir/seeds.rc" ] && [ -f "$dir/a8.rc" ] && break
  [ "$(date +%s)" -ge "$end" ] && break
  sleep 60
done
tail -n 25 "$dir/seeds.out" "$dir/a8.out" | grep -v "it/s\]" | cut -c1-400
(cd "$dir" && tar czf "$OUT/results.tgz" --exclude='*/checkpoints' --exclude='*/iterations' --exclude='*/eval' \
   --exclude='*/validation' --exclude='*/warmup' --exclude='*.sqlite' --exclude='app' \
   --exclude='gold_samples.jsonl' seeds a8 seeds.out a8.out 2>/dev/null)
ls -la "$OUT"

#!/usr/bin/env bash
# Issue 11's experiments on one lent H200, several at once, resumable across calls:
#     source scripts/device/prepare.sh && RUNS="p n k s" bash scripts/device/issue11.sh SECONDS
# Every call runs for at most SECONDS, stops what is still running (each loop resumes from its
# run directory when the next call runs this again) and copies the small results to $OUT.
#   p  the preset, one command: warm start, then REINFORCE with group advantages and a KL to the warm start
#   g  GRPO (PPO clip, 2 passes per iteration) with the same KL, from p's warm-start checkpoint
#   o  the original TapeAgents settings (configs/original.yaml), from the same checkpoint
#   n  REINFORCE without the KL term, 16 attempts per problem (256 problems per iteration), from the same
#   k  REINFORCE with the preset's KL, 16 attempts per problem, from the same
#   q  p's command from p's warm-start checkpoint with QEXTRA added (a one-knob variant of p: a learning rate, ...)
#   s  the SFT-only control, gold solutions for as many tokens as p (or CONTROL_OF=k, ...) trained; it
#      catches up with that run's evaluations while it runs and is done once it is
# RUNS picks which (default "p g o s"). They share the GPU (the 135M model leaves most of it idle),
# each with 15 % of free memory for KV. EXTRA: overrides appended to every command, PEXTRA to p's
# only (the third session's p had the preset's KL 0.1; the fifth ran PEXTRA=finetune.rl.kl_coef=0.01;
# the seventh PEXTRA="attempts=16 iterations=72 test_every_n_iterations=4", since then the preset's own;
# the eighth RUNS="p q" PEXTRA="iterations=96" QEXTRA="sampling.temperature=0.7").
budget=${1:-500}
end=$(( $(date +%s) + budget ))
X=$HOME/x
mkdir -p "$X"
rm -f "$X"/*.rc  # exit codes of the last call: those runs were stopped at its end
share="sampling.kv_memory_fraction=0.15 ${EXTRA:-}"
declare -A pid
RUNS=" ${RUNS:-p g o s} "
like=${CONTROL_OF:-p}  # the run whose tokens the SFT control matches
wants() { [[ "$RUNS" == *" $1 "* ]]; }

state_key() {  # state_key RUN KEY: a key of RUN/state.json, or nothing
  python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get(sys.argv[2]) or '')" "$1/state.json" "$2" 2>/dev/null
}
evals() {  # evals RUN: how many rows of RUN/metrics.jsonl carry a test evaluation
  python3 -c "import json,sys; print(sum(json.loads(l).get('test_accuracy_strict') is not None for l in open(sys.argv[1])))" \
    "$1/metrics.jsonl" 2>/dev/null || echo 0
}
done_run() { [ "$(state_key "$1" phase)" = done ]; }

launch() {  # launch NAME COMMAND...: in its own process group, output appended to $X/NAME.log
  local name=$1; shift
  echo "=== $(date -u +%FT%TZ) start: $*" >> "$X/$name.log"
  rm -f "$X/$name.rc"
  setsid bash -c '"$@"; echo $? > "$0"' "$X/$name.rc" "$@" >> "$X/$name.log" 2>&1 &
  pid[$name]=$!
}
running() { [ -n "${pid[$1]:-}" ] && kill -0 "${pid[$1]}" 2>/dev/null; }
# A run that exited with an error in this call is not launched again in it, nor waited for.
failed() { ! running "$1" && [ -f "$X/$1.rc" ] && [ "$(cat "$X/$1.rc")" != 0 ]; }
startable() { wants "$1" && ! done_run "$X/$1" && ! running "$1" && ! failed "$1"; }

startable p && launch p python3 -m gsm8kctl loop --config configs/h200-smollm2.yaml --model "$SMOLLM2" --run-dir "$X/p" $share ${PEXTRA:-}
while [ "$(date +%s)" -lt "$end" ]; do
  start=$(state_key "$X/p" start_model)
  if [ -n "$start" ] && [ -f "$start/config.json" ]; then
    from_start=(--config configs/h200-smollm2.yaml --model "$start" warmup_sft_steps=0)
    if startable g; then
      launch g python3 -m gsm8kctl loop "${from_start[@]}" --run-dir "$X/g" \
        iterations=24 test_every_n_iterations=4 finetune.objective=grpo finetune.rl.algo=grpo \
        finetune.epochs=2 $share
    fi
    if startable o; then
      launch o python3 -m gsm8kctl loop --config configs/original.yaml --model "$start" --run-dir "$X/o" iterations=15 $share
    fi
    if startable n; then
      launch n python3 -m gsm8kctl loop "${from_start[@]}" --run-dir "$X/n" attempts=16 \
        finetune.rl.kl_coef=0 filter.ref_model=null $share
    fi
    if startable q; then
      launch q python3 -m gsm8kctl loop "${from_start[@]}" --run-dir "$X/q" ${PEXTRA:-} ${QEXTRA:-} $share
    fi
    if startable k; then
      launch k python3 -m gsm8kctl loop "${from_start[@]}" --run-dir "$X/k" attempts=16 ${PEXTRA:-} $share
    fi
  fi
  # The control trains to p's token count at each of p's evaluations that it has not yet matched.
  control=(python3 scripts/sft_control.py "$X/s" --like "$X/$like" finetune.rl.kl_coef=0 filter.ref_model=null $share)
  if wants s && ! running s && ! failed s && [ ! -f "$X/s.done" ]; then
    if done_run "$X/$like"; then
      launch s bash -c '"$@" && touch "$0"' "$X/s.done" "${control[@]}"
    elif [ "$(evals "$X/$like")" -gt "$(evals "$X/s")" ]; then
      launch s "${control[@]}"
    fi
  fi
  all_done=1
  for r in p g o n k q; do wants $r && ! done_run "$X/$r" && ! failed $r && all_done=0; done
  # The control is finished for this call once p stopped and it matched every evaluation of p's.
  if wants s && [ ! -f "$X/s.done" ] && ! failed s && { running s || running $like || [ "$(evals "$X/$like")" -gt "$(evals "$X/s")" ]; }; then
    all_done=0
  fi
  if failed p && [ -z "$start" ]; then all_done=1; fi  # the others start from p's warm start
  if [ $all_done = 1 ]; then
    break
  fi
  sleep 5
done
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv >> "$X/gpu.log" 2>&1
for name in "${!pid[@]}"; do  # what is still running stops here and resumes in the next call
  if running "$name"; then
    echo "=== $(date -u +%FT%TZ) stopped at the call's end" >> "$X/$name.log"
    kill -TERM -- "-${pid[$name]}" 2>/dev/null
  fi
done
sleep 15
for name in "${!pid[@]}"; do kill -KILL -- "-${pid[$name]}" 2>/dev/null; done
wait 2>/dev/null
# The small files: metrics, states, configs, evaluation metrics, logs (no tapes, no weights).
cd "$X" && find . \( -name 'metrics.jsonl' -o -name 'metrics.json' -o -name 'state.json' -o -name 'config.yaml' \
  -o -name '*.log' -o -name 's.done' \) -not -path '*/checkpoints/*' -print0 | tar -czf "$OUT/issue11.tgz" --null -T -
for r in p g o n k q s; do [ -f "$X/$r/metrics.jsonl" ] && echo "$r: $(wc -l < "$X/$r/metrics.jsonl") rows, phase $(state_key "$X/$r" phase) it $(state_key "$X/$r" iteration)"; done
tail -n 3 "$X"/*.log

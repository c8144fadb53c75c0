#!/usr/bin/env bash
# Issue 11's experiments on one lent H200, several at once, resumable across calls:
#     source scripts/device/prepare.sh && bash scripts/device/issue11.sh SECONDS
# Every call runs for at most SECONDS, stops what is still running (each loop resumes from its
# run directory when the next call runs this again) and copies the small results to $OUT.
#   p  the preset, one command: warm start, then REINFORCE with group advantages and a KL to the warm start
#   g  GRPO (PPO clip, 2 passes per iteration) with the same KL, from p's warm-start checkpoint
#   o  the original TapeAgents settings (configs/original.yaml), from the same checkpoint
#   s  the SFT-only control, gold solutions for as many tokens as p trained (after p is done)
# They share the GPU (the 135M model leaves most of it idle), each with 15 % of free memory for KV.
# EXTRA: overrides appended to every command, PEXTRA to p's only (a CPU dry run with a tiny model sets sizes there).
budget=${1:-500}
end=$(( $(date +%s) + budget ))
X=$HOME/x
mkdir -p "$X"
share="sampling.kv_memory_fraction=0.15 ${EXTRA:-}"
declare -A pid

state_key() {  # state_key RUN KEY: a key of RUN/state.json, or nothing
  python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get(sys.argv[2]) or '')" "$1/state.json" "$2" 2>/dev/null
}
done_run() { [ "$(state_key "$1" phase)" = done ]; }

launch() {  # launch NAME COMMAND...: in its own process group, output appended to $X/NAME.log
  local name=$1; shift
  echo "=== $(date -u +%FT%TZ) start: $*" >> "$X/$name.log"
  setsid "$@" >> "$X/$name.log" 2>&1 &
  pid[$name]=$!
}
running() { [ -n "${pid[$1]:-}" ] && kill -0 "${pid[$1]}" 2>/dev/null; }

done_run "$X/p" || launch p python3 -m gsm8kctl loop --config configs/h200-smollm2.yaml --model "$SMOLLM2" --run-dir "$X/p" $share ${PEXTRA:-}
while [ "$(date +%s)" -lt "$end" ]; do
  start=$(state_key "$X/p" start_model)
  if [ -n "$start" ] && [ -f "$start/config.json" ]; then
    if ! done_run "$X/g" && ! running g; then
      launch g python3 -m gsm8kctl loop --config configs/h200-smollm2.yaml --model "$start" --run-dir "$X/g" \
        warmup_sft_steps=0 iterations=24 test_every_n_iterations=4 finetune.objective=grpo finetune.rl.algo=grpo \
        finetune.epochs=2 $share
    fi
    if ! done_run "$X/o" && ! running o; then
      launch o python3 -m gsm8kctl loop --config configs/original.yaml --model "$start" --run-dir "$X/o" iterations=15 $share
    fi
  fi
  if done_run "$X/p" && ! running s && [ ! -f "$X/s.done" ]; then
    launch s bash -c "python3 scripts/sft_control.py '$X/s' --like '$X/p' finetune.rl.kl_coef=0 \
      filter.ref_model=null $share && touch '$X/s.done'"
  fi
  if done_run "$X/p" && done_run "$X/g" && done_run "$X/o" && [ -f "$X/s.done" ]; then
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
for r in p g o s; do [ -f "$X/$r/metrics.jsonl" ] && echo "$r: $(wc -l < "$X/$r/metrics.jsonl") rows, phase $(state_key "$X/$r" phase) it $(state_key "$X/$r" iteration)"; done
tail -n 3 "$X"/*.log

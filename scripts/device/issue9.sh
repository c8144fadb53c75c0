#!/usr/bin/env bash
# Issue 9's measurements on the lent H200, one part per `run` call (after `source scripts/device/prepare.sh`):
#   bash scripts/device/issue9.sh kernel   # split-K kernel vs flash, step profile, random-init shapes (no weights)
#   bash scripts/device/issue9.sh cli      # the real SmolLM2 ($SMOLLM2, both GGUF parts carried): sample/evaluate
# JSON goes to $OUT (the device tool brings it back); copy it to docs/bench/ by hand.
set -u
part=${1:?kernel or cli}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
case $part in
  kernel)
    python3 scripts/profile_slot_step.py --shape 135m --slots 1024,2048,4096 --out "$OUT/profile-135m.json"
    python3 scripts/bench_gpu_sampling.py --parts shapes --tokenizer .devdata/tok --out "$OUT/shapes.json" ${EXTRA:-}
    ;;
  cli)
    python3 scripts/bench_gpu_sampling.py --parts cli --model "$SMOLLM2" --data-dir "$GSM8K_DIR" \
      --attentions "${ATTENTIONS:-split_k,flash}" --out "$OUT/cli.json"
    ;;
esac

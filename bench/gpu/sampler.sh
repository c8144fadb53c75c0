#!/usr/bin/env bash
# The sampler's GPU measurements (docs/benchmarks.md), one part per call, after `source bench/gpu/prepare.sh`:
#   bash bench/gpu/sampler.sh kernel   # split-K kernel vs flash, step profile, random-init shapes (no weights)
#   bash bench/gpu/sampler.sh step     # one decode step: transformers' module, our decoder, fused kernels
#   bash bench/gpu/sampler.sh score    # score() against sampling (random init, no weights), and where imports go
#   bash bench/gpu/sampler.sh cli      # the real SmolLM2 ($SMOLLM2, from both GGUF parts): sample/evaluate
#   bash bench/gpu/sampler.sh sdpa     # SDPA's first call of a new shape by backend set; admissions with each (no weights)
#   bash bench/gpu/sampler.sh profile  # the real SmolLM2: one sample and one evaluate process, phase by phase, twice
# JSON goes to the directory $OUT; copy what a table cites to docs/bench/<topic>/<date>-<hardware>-<what>.
set -u
part=${1:?kernel or cli}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
case $part in
  kernel)
    python3 bench/profile_slot_step.py --shape 135m --slots 1024,2048,4096 --out "$OUT/profile-135m.json"
    python3 bench/bench_gpu_sampling.py --parts shapes --tokenizer .devdata/tok --out "$OUT/shapes.json" ${EXTRA:-}
    ;;
  step)  # one decode step on transformers' module, our decoder, and our decoder with fused kernels
    python3 bench/profile_slot_step.py --shape 135m --slots ${SLOTS:-1024,2048} --models hf,native,fused \
      --variants "split_k,no attention" --tilings 512x64w4s3 --score-budgets 65536 --out "$OUT/step.json"
    ;;
  sdpa)  # each set in fresh processes, alternating: first calls of new shapes, then a whole engine run's admissions
    for run in 1 2; do
      for set in default no-cudnn; do
        python3 bench/profile_sdpa_shapes.py --backends $set --out "$OUT/sdpa-$set-$run.json"
      done
    done
    for sdpa in default ours; do
      python3 bench/profile_admission.py --tokenizer .devdata/tok --sdpa $sdpa --out "$OUT/admission-$sdpa.json" \
        | grep -E '"(wall_s|admit_s|prefill_s|F.scaled_dot_product_attention|fused add_rmsnorm)"'
    done
    ;;
  score)
    python3 bench/bench_gpu_sampling.py --parts score --tokenizer .devdata/tok --out "$OUT/score.json" ${EXTRA:-}
    # What a sample process pays before its first token: the imports, then CUDA's init.
    python3 -X importtime -c "import gsm8kctl.backends.transformers" 2> "$OUT/importtime.txt"
    python3 -c "import time; t=time.perf_counter(); import torch; a=time.perf_counter(); import transformers, gsm8kctl.backends.transformers; b=time.perf_counter(); torch.zeros(1, device='cuda'); c=time.perf_counter(); print(f'import torch {a-t:.2f} s, transformers + backend {b-a:.2f} s, CUDA init {c-b:.2f} s')"
    sort -t'|' -k2 -n "$OUT/importtime.txt" | tail -n 30
    ;;
  cli)
    python3 bench/bench_gpu_sampling.py --parts cli --model "$SMOLLM2" --data-dir "$GSM8K_DIR" \
      --attentions "${ATTENTIONS:-split_k,flash}" --out "$OUT/cli.json"
    ;;
  profile)  # where one sample / evaluate process's wall time goes (bench/profile_sample.py),
            # alternating the variants in $VARIANTS (default: the host gate and without it, --no-gate)
    common="--model $SMOLLM2 --backend transformers -q ${EXTRA:-}"
    for run in 1 2; do
      for gate in ${VARIANTS:-gate no-gate}; do
        flag=$(case $gate in no-gate) echo --no-gate;; no-overlap) echo --no-overlap;; sdpa-default) echo --sdpa-default;; esac)
        code=$(case $gate in hf) echo transformers.model_code=hf;; esac)  # variant hf: transformers' module
        rm -rf "/tmp/prof-$gate-$run" "/tmp/prof-eval-$gate-$run"
        python3 bench/profile_sample.py $flag --out "$OUT/profile-sample-$gate-$run.json" -- sample $common \
          -o "/tmp/prof-$gate-$run/tapes.jsonl" --n-problems 1024 --attempts 8 --temperature 1.0 --max-tokens 512 $code
        python3 bench/profile_sample.py $flag --out "$OUT/profile-evaluate-$gate-$run.json" -- evaluate $common \
          -o "/tmp/prof-eval-$gate-$run" --json $code
      done
    done
    ;;
esac

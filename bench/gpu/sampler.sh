#!/usr/bin/env bash
# The sampler's GPU measurements (docs/benchmarks.md, "Sampler on the GPU"), one part per call,
# from the repository root on a machine with a CUDA GPU, after `source bench/gpu/prepare.sh`:
#   bash bench/gpu/sampler.sh kernel   # split-K kernel vs flash, step profile, random-init shapes (no weights)
#   bash bench/gpu/sampler.sh step     # one decode step: transformers' module, our decoder, fused kernels
#   bash bench/gpu/sampler.sh score    # score() against sampling (random init, no weights), and where imports go
#   bash bench/gpu/sampler.sh cli      # the real SmolLM2: whole sample/evaluate commands
#   bash bench/gpu/sampler.sh sdpa     # SDPA's first call of a new shape by backend set; admissions with each (no weights)
#   bash bench/gpu/sampler.sh profile  # the real SmolLM2: one sample and one evaluate process, phase by phase, twice
# Reads: MODEL, the SmolLM2-135M-Instruct directory for `cli` and `profile` [$SMOLLM2]; TOKENIZER, a
# SmolLM2 tokenizer directory for the random-init parts [$SMOLLM2]; GSM8K_DIR, the GSM8k data
# directory; OUT, where the JSON goes [out/gpu]; PYTHON [python3]; EXTRA, arguments appended to the
# benchmark commands; SLOTS (`step`), ATTENTIONS (`cli`) and VARIANTS (`profile`), see below.
# Copy what a table cites to docs/bench/<topic>/<date>-<hardware>-<what>.
set -u
part=${1:?which part: kernel, step, score, cli, sdpa or profile}
OUT=${OUT:-out/gpu}
PY=${PYTHON:-python3}
MODEL=${MODEL:-${SMOLLM2:-}}
TOKENIZER=${TOKENIZER:-${SMOLLM2:-}}
case $part in kernel|step|score|cli|sdpa|profile) ;; *) echo "unknown part $part: kernel, step, score, cli, sdpa or profile" >&2; exit 2;; esac
mkdir -p "$OUT"
need() { [ -n "$2" ] || { echo "part $part needs $1 (source bench/gpu/prepare.sh, or set it)" >&2; exit 2; }; }
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
case $part in
  kernel)
    need TOKENIZER "$TOKENIZER"
    $PY bench/profile_slot_step.py --shape 135m --slots 1024,2048,4096 --out "$OUT/profile-135m.json"
    $PY bench/bench_gpu_sampling.py --parts shapes --tokenizer "$TOKENIZER" --out "$OUT/shapes.json" ${EXTRA:-}
    ;;
  step)  # one decode step on transformers' module, our decoder, and our decoder with fused kernels
    $PY bench/profile_slot_step.py --shape 135m --slots ${SLOTS:-1024,2048} --models hf,native,fused \
      --variants "split_k,no attention" --tilings 512x64w4s3 --score-budgets 65536 --out "$OUT/step.json"
    ;;
  sdpa)  # each set in fresh processes, alternating: first calls of new shapes, then a whole engine run's admissions
    need TOKENIZER "$TOKENIZER"
    for run in 1 2; do
      for set in default no-cudnn; do
        $PY bench/profile_sdpa_shapes.py --backends $set --out "$OUT/sdpa-$set-$run.json"
      done
    done
    for sdpa in default ours; do
      $PY bench/profile_admission.py --tokenizer "$TOKENIZER" --sdpa $sdpa --out "$OUT/admission-$sdpa.json" \
        | grep -E '"(wall_s|admit_s|prefill_s|F.scaled_dot_product_attention|fused add_rmsnorm)"'
    done
    ;;
  score)
    need TOKENIZER "$TOKENIZER"
    $PY bench/bench_gpu_sampling.py --parts score --tokenizer "$TOKENIZER" --out "$OUT/score.json" ${EXTRA:-}
    # What a sample process pays before its first token: the imports, then CUDA's init.
    $PY -X importtime -c "import gsm8kctl.sampling.backends.transformers" 2> "$OUT/importtime.txt"
    $PY -c "import time; t=time.perf_counter(); import torch; a=time.perf_counter(); import transformers, gsm8kctl.sampling.backends.transformers; b=time.perf_counter(); torch.zeros(1, device='cuda'); c=time.perf_counter(); print(f'import torch {a-t:.2f} s, transformers + backend {b-a:.2f} s, CUDA init {c-b:.2f} s')"
    sort -t'|' -k2 -n "$OUT/importtime.txt" | tail -n 30
    ;;
  cli)  # ATTENTIONS: the decode attentions to compare [split_k,flash]
    need MODEL "$MODEL"
    $PY bench/bench_gpu_sampling.py --parts cli --model "$MODEL" --data-dir "$GSM8K_DIR" \
      --attentions "${ATTENTIONS:-split_k,flash}" --out "$OUT/cli.json"
    ;;
  profile)  # where one sample / evaluate process's wall time goes (bench/profile_sample.py),
            # alternating the variants in $VARIANTS [gate no-gate]: gate, no-gate (the host gate
            # patched out), overlap, no-overlap, sdpa-default, native, hf (transformers' module)
    need MODEL "$MODEL"
    common="--model $MODEL --backend transformers -q ${EXTRA:-}"
    tmp=${TMPDIR:-/tmp}
    for run in 1 2; do
      for gate in ${VARIANTS:-gate no-gate}; do
        flag=$(case $gate in no-gate) echo --no-gate;; no-overlap) echo --no-overlap;; sdpa-default) echo --sdpa-default;; esac)
        code=$(case $gate in hf) echo transformers.model_code=hf;; esac)  # variant hf: transformers' module
        rm -rf "$tmp/prof-$gate-$run" "$tmp/prof-eval-$gate-$run"
        $PY bench/profile_sample.py $flag --out "$OUT/profile-sample-$gate-$run.json" -- sample $common \
          -o "$tmp/prof-$gate-$run/tapes.jsonl" --n-problems 1024 --attempts 8 --temperature 1.0 --max-tokens 512 $code
        $PY bench/profile_sample.py $flag --out "$OUT/profile-evaluate-$gate-$run.json" -- evaluate $common \
          -o "$tmp/prof-eval-$gate-$run" --json $code
      done
    done
    ;;
esac

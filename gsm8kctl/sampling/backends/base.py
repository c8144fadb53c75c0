"""The backend protocol: sample completions and score given completions, token ids in and out.

Prompts travel as token ids (rendered once by the chat template in `gsm8kctl.agent`/`prompts`), so
what the sampler saw is exactly what the trainer trains on: no re-tokenisation anywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from gsm8kctl.errors import UserError


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float] | None  # sampler log-prob of each chosen token (None if not returned)
    finish_reason: str  # "stop" (eos / stop token) or "length" (hit max_tokens)
    text: str  # decoded completion, special tokens skipped
    latency_s: float = 0.0  # wall time of the request/batch that produced it, shared by a batch


def _sampling_default(key: str):
    from gsm8kctl.config import setting

    return setting(None, f"sampling.{key}")


@dataclass
class SamplingParams:
    """What one sampling call asks for. Left out, temperature, top_p and max_tokens are the
    config's `sampling.*` defaults (default.yaml, sized for this machine): stated in one place."""
    n: int = 1
    temperature: float = field(default_factory=lambda: _sampling_default("temperature"))  # 0 = greedy
    top_p: float = field(default_factory=lambda: _sampling_default("top_p"))
    max_tokens: int = field(default_factory=lambda: _sampling_default("max_tokens"))
    seed: int | None = None
    # One seed per completion, prompt-major (len(prompts) * n); overrides `seed`. The sample
    # stage derives them from tape ids, so an attempt redone after a crash draws the same tokens.
    seeds: list[int] | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"n": self.n, "temperature": self.temperature, "top_p": self.top_p,
                "max_tokens": self.max_tokens, "seed": self.seed, **self.extra}


def completion_seeds(params: SamplingParams, count: int) -> list[int]:
    """The seed of each of `count` completions: `params.seeds`, else derived from `params.seed`
    (distinct per completion), else fresh randomness."""
    from gsm8kctl.sampling.backends.sampling import completion_seed

    if params.seeds is not None:
        if len(params.seeds) != count:
            raise ValueError(f"{len(params.seeds)} seeds for {count} completions")
        return list(params.seeds)
    base = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
    return [completion_seed(base, k) for k in range(count)]


def check_decode_attention(attention: str, device: str) -> None:
    """`transformers.decode_attention` split_k and flash are CUDA kernels: refused elsewhere, in one line."""
    if attention in ("split_k", "flash") and device != "cuda":
        raise UserError(f"transformers.decode_attention={attention} needs CUDA (this run is on the "
                        f"{device}); use auto or sdpa")


class Backend(Protocol):
    name: str  # "transformers" | "vllm" | "openai"
    model: str  # what the tapes record as the model (path or id)
    tokenizer: object  # Hugging Face tokenizer of the model

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt (token ids), `params.n` completions, in prompt order."""
        ...

    def score(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[list[float]]:
        """Log-prob of each completion token given prompt + preceding completion tokens.

        Runs in bounded memory whatever the vocabulary: chunked by a token budget.
        """
        ...

    def close(self) -> None:
        ...

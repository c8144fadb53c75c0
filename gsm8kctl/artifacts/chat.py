"""Render chat messages to token ids once, with the model's own chat template.

The ids made here are what the sampler sees and what the trainer trains on.
"""

from __future__ import annotations


def render_prompt(tokenizer, messages: list[dict]) -> tuple[str, list[int]]:
    """Prompt text and ids ending with the assistant header (generation prompt)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text, list(ids)


def render_completion(tokenizer, text: str) -> list[int]:
    """Ids of an assistant answer written by us (gold SFT data), ending with the end-of-turn token."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(ids) + [int(tokenizer.eos_token_id)]

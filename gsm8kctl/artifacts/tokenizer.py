"""A model's tokenizer and chat template without transformers: the Rust `tokenizers` library and jinja2.

Why: `from transformers import AutoTokenizer` imports transformers' top level, which pulls in
torch._dynamo, torch.distributed.tensor and sympy (1.9 s on the 2-core CPU, more on the H200
image); a sampling process that runs the decoder of `backends/llama.py` needs none of it.

`ChatTokenizer` is the part of a transformers fast tokenizer that sampling uses, with the same
results: the chat template rendered as `apply_chat_template` renders it (a sandboxed jinja2
environment with trim_blocks and lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson`
that does not escape HTML, the special tokens as variables), text encoded by the same Rust
tokenizer, special tokens from tokenizer_config.json. tests/test_tokenizer.py compares both on
GSM8k prompts. `models.load_chat_tokenizer` loads transformers' for a directory without
tokenizer.json or a chat template string.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _content(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def chat_template_of(path: Path, config: dict) -> str | None:
    """The template transformers would use: chat_template.jinja, else the config's string (or its
    list's "default" entry)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def compile_template(template: str):
    """The chat template as transformers compiles it (sandboxed, its extensions and helpers)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers): rendered as their body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class ChatTokenizer:
    """What sampling needs of a tokenizer: chat template, encode, decode, special token ids."""

    def __init__(self, path: Path, config: dict, template: str):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        special = {}
        extra = path / "special_tokens_map.json"
        if extra.is_file():
            special.update({k: _content(v) for k, v in json.loads(extra.read_text()).items() if k in SPECIAL})
        special.update({k: _content(config[k]) for k in SPECIAL if _content(config.get(k)) is not None})
        self.bos_token, self.eos_token = special.get("bos_token"), special.get("eos_token")
        self.unk_token = special.get("unk_token")
        # As load_tokenizer does with transformers' tokenizer: no pad token means eos.
        self.pad_token = special.get("pad_token") or self.eos_token
        self._template = compile_template(template)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        found = self._tokenizer.token_to_id(token)
        return found if found is not None else self.unk_token_id  # as transformers: unknown = unk

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], *, tokenize: bool = False, add_generation_prompt: bool = False):
        specials = {k: getattr(self, k) for k in SPECIAL if getattr(self, k) is not None}
        text = self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **specials)
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

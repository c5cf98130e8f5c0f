"""A Llama-family decoder layer in plain torch, float32, over calibration batches `[B, T, hidden]`
(every sequence starts at position 0, causal attention), cut into the pieces the quantization
methods need to see: each linear layer's input, and the attention / MLP sub-blocks as
functions of their weights. Same math as pagedllm's model (`model/llama.py`): RMSNorm, RoPE
(`layers/rotary.py`), grouped-query attention with optional q/k/v biases, SiLU-gated MLP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.layers.rotary import compute_inv_freq, head_dim_of, rotate_half

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass
class BlockShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    sliding_window: int | None

    @classmethod
    def from_config(cls, hf_config: Any) -> "BlockShape":
        model_type = getattr(hf_config, "model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"calibrated quantization supports llama, mistral and qwen2 models, not {model_type!r}")
        heads = hf_config.num_attention_heads
        window = getattr(hf_config, "sliding_window", None) if model_type != "llama" else None
        if model_type == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
            window = None
        return cls(heads, getattr(hf_config, "num_key_value_heads", None) or heads, head_dim_of(hf_config),
                   float(hf_config.rms_norm_eps), window)


class Rope:
    """cos / sin `[T, head_dim]` for positions 0 .. T-1."""

    def __init__(self, hf_config: Any) -> None:
        self.inv_freq, self.scaling = compute_inv_freq(hf_config)
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        if t not in self._cache:
            freqs = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cache[t] = (emb.cos() * self.scaling, emb.sin() * self.scaling)
        return self._cache[t]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def linear(x: torch.Tensor, w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))


def attention_core(x: torch.Tensor, w: dict[str, torch.Tensor], shape: BlockShape, rope: Rope) -> torch.Tensor:
    """The attention output before o_proj, `[B, T, heads * head_dim]`, from the normed input."""
    b, t, _ = x.shape
    hd = shape.head_dim
    q = linear(x, w, "q_proj").view(b, t, shape.num_heads, hd).transpose(1, 2)
    k = linear(x, w, "k_proj").view(b, t, shape.num_kv_heads, hd).transpose(1, 2)
    v = linear(x, w, "v_proj").view(b, t, shape.num_kv_heads, hd).transpose(1, 2)
    cos, sin = rope(t)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    rep = shape.num_heads // shape.num_kv_heads
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if shape.sliding_window is not None and shape.sliding_window < t:
        i = torch.arange(t)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < shape.sliding_window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1 / math.sqrt(hd))
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(hd))
    return out.transpose(1, 2).reshape(b, t, shape.num_heads * hd)


def self_attn(x: torch.Tensor, w: dict[str, torch.Tensor], shape: BlockShape, rope: Rope) -> torch.Tensor:
    """The attention sub-block's output (o_proj applied) from the normed input."""
    return linear(attention_core(x, w, shape, rope), w, "o_proj")


def mlp_act(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """down_proj's input from the normed input."""
    return F.silu(linear(x, w, "gate_proj")) * linear(x, w, "up_proj")


def mlp(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    return linear(mlp_act(x, w), w, "down_proj")


def layer_weights(weights: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Layer `i`'s tensors with short names (`q_proj.weight`, `input_layernorm.weight`, ...)."""
    prefix = f"model.layers.{i}."
    out = {}
    for name, t in weights.items():
        if name.startswith(prefix):
            short = name[len(prefix):]
            for part in ("self_attn.", "mlp."):
                short = short.removeprefix(part)
            out[short] = t.to(torch.float32)
    return out


def full_name(i: int, short: str) -> str:
    """The checkpoint name of layer `i`'s short name."""
    mod = short.split(".")[0]
    part = "self_attn." if mod in ATTN else "mlp." if mod in MLP else ""
    return f"model.layers.{i}.{part}{short}"

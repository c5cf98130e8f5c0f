"""Rotary position embedding (RoPE), numerically the same as transformers' Llama rotary.

Frequencies honour `rope_theta` and the rope scaling types `default`, `linear` and `llama3`
(computed here exactly as `transformers.modeling_rope_utils` does) and `yarn` (delegated to
transformers' `ROPE_INIT_FUNCTIONS`, which returns a static table and an attention factor).
Types whose frequencies depend on the running sequence length (`dynamic`, `longrope`) are refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.layers.fused import fused_kernel_for


def _rope_params(hf_config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict with a `rope_type` key) from a transformers 5 or 4 config."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and "rope_theta" in params:
        # transformers 5: {"rope_type": ..., "rope_theta": ..., scaling keys...}
        scaling = dict(params)
        theta = float(scaling.pop("rope_theta"))
    else:
        theta = getattr(hf_config, "rope_theta", None)
        theta = float(theta) if theta is not None else 10000.0
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    scaling["rope_type"] = rope_type
    return theta, scaling


def head_dim_of(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def compute_inv_freq(hf_config: Any) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [head_dim // 2], attention_scaling) for the config's RoPE."""
    theta, scaling = _rope_params(hf_config)
    rope_type = scaling["rope_type"]
    dim = head_dim_of(hf_config)
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported for Llama-family models")
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed, inv_freq_llama), 1.0
    if rope_type == "yarn":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
        return inv_freq.to(torch.float32).cpu(), float(attention_scaling)
    raise ValueError(
        f"Unsupported rope scaling type {rope_type!r}; supported: ['default', 'linear', 'llama3', 'yarn']"
    )


class RotaryEmbedding(nn.Module):
    """Maps positions `[T]` to `(cos, sin)` of shape `[T, head_dim]` in float32."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
        self.attention_scaling = attention_scaling

    @classmethod
    def from_config(cls, hf_config: Any, device: torch.device | str | None = None) -> "RotaryEmbedding":
        inv_freq, scaling = compute_inv_freq(hf_config)
        return cls(inv_freq.to(device), scaling)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def apply_rotary_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `q [T, Hq, D]` and `k [T, Hk, D]` by `cos/sin [T, D]` (cast to q's dtype first)."""
    cos = cos.to(q.dtype).unsqueeze(1)
    sin = sin.to(q.dtype).unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused projection `qkv [T, (Hq + 2 Hk) * D]` into q `[T, Hq, D]`, k, v `[T, Hk, D]`
    with q and k rotated: in place in `qkv` by the C kernel where it applies (the caller's fresh
    projection output), else with `apply_rotary_emb`."""
    tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != q_size + 2 * kv_size:
        raise ValueError(f"rotate_qkv: qkv {tuple(qkv.shape)} must be [tokens, (heads {num_heads} + 2 x kv heads "
                         f"{num_kv_heads}) x head_dim {head_dim} = {q_size + 2 * kv_size}]")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (tokens, head_dim):
            raise ValueError(f"rotate_qkv: {name} {tuple(t.shape)} must be (tokens, head_dim) = {(tokens, head_dim)}")
    kernel = fused_kernel_for(qkv, cos, sin) if qkv.dim() == 2 else None
    if kernel is not None:
        kernel.rotary(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, qkv.shape[1], num_heads + num_kv_heads,
                      head_dim, torch.get_num_threads())  # fmt: skip
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(tokens, num_heads, head_dim)
    k = k.view(tokens, num_kv_heads, head_dim)
    v = v.view(tokens, num_kv_heads, head_dim)
    if kernel is None:
        q, k = apply_rotary_emb(q, k, cos, sin)
    return q, k, v

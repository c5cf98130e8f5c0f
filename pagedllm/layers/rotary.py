"""Rotary position embedding (RoPE), numerically the same as transformers' Llama rotary.

Frequencies honour `rope_theta` and the rope scaling types `default`, `linear` and `llama3`
(computed here exactly as `transformers.modeling_rope_utils` does), `yarn` (delegated to
transformers' `ROPE_INIT_FUNCTIONS`, which returns a static table and an attention factor) and
`longrope` (Phi-3 / Phi-4: two tables, `LongRopeEmbedding`). `partial_rotary_factor < 1` rotates
only the first `rotary_dim` dimensions of each head (Phi-4-mini: 0.75). `dynamic` is refused.

LongRoPE picks its short or long factors by the sequence's length, as transformers does: a
sequence longer than `original_max_position_embeddings` uses the long factors at every position,
a shorter one the short factors. The scheduler keeps each sequence in one regime
(`long_context_threshold`, `Sequence.long_context`): a sequence that grows past the limit is
recomputed once, as transformers' Phi-3 drops its cache at that point.
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


def rotary_dim_of(hf_config: Any) -> int:
    """How many leading dimensions of each head are rotated (`head_dim * partial_rotary_factor`)."""
    _, scaling = _rope_params(hf_config)
    factor = scaling.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None)) or 1.0
    dim = int(head_dim_of(hf_config) * factor)
    if dim < 2 or dim % 2:
        raise ValueError(f"partial_rotary_factor {factor} gives {dim} rotary dimensions of head_dim "
                         f"{head_dim_of(hf_config)}: it must be a positive even number")
    return dim


def long_context_threshold(hf_config: Any, max_model_len: int) -> int | None:
    """The length past which a sequence switches to LongRoPE's long factors (None: never, also
    when `max_model_len` cannot exceed it): the scheduler's `long_context_after`."""
    _, scaling = _rope_params(hf_config)
    if scaling["rope_type"] != "longrope":
        return None
    original = int(scaling.get("original_max_position_embeddings")
                   or getattr(hf_config, "original_max_position_embeddings", 0) or hf_config.max_position_embeddings)
    return original if max_model_len > original else None


def compute_inv_freq(hf_config: Any) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [rotary_dim // 2], attention_scaling) for the config's RoPE (longrope:
    its short factors; `LongRopeEmbedding` holds both)."""
    theta, scaling = _rope_params(hf_config)
    rope_type = scaling["rope_type"]
    dim = rotary_dim_of(hf_config)
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
    if rope_type in ("yarn", "longrope"):
        return _transformers_inv_freq(hf_config, rope_type)
    raise ValueError(
        f"Unsupported rope scaling type {rope_type!r}; supported: ['default', 'linear', 'llama3', 'yarn', 'longrope']"
    )


def _transformers_inv_freq(hf_config: Any, rope_type: str, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """transformers' own table for `rope_type` (`seq_len`: longrope's length, which picks its
    factors)."""
    # lazy: transformers (2 s) only for the rope types whose tables come from it
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {"seq_len": seq_len} if seq_len is not None else {}
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, **kwargs)
    return inv_freq.to(torch.float32).cpu(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """Maps positions `[T]` to `(cos, sin)` of shape `[T, head_dim]` in float32."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
        self.attention_scaling = attention_scaling

    @classmethod
    def from_config(cls, hf_config: Any, device: torch.device | str | None = None) -> "RotaryEmbedding":
        """The embedding of the config's rope type (a `LongRopeEmbedding` for longrope)."""
        if _rope_params(hf_config)[1]["rope_type"] == "longrope":
            return LongRopeEmbedding.from_config(hf_config, device)
        inv_freq, scaling = compute_inv_freq(hf_config)
        return cls(inv_freq.to(device), scaling)

    def forward(self, positions: torch.Tensor, attn_metadata: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin)` `[T, rotary_dim]` (`attn_metadata` is read by length-dependent subclasses)."""
        return self._cos_sin(positions, self.inv_freq)

    def _cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


class LongRopeEmbedding(RotaryEmbedding):
    """LongRoPE: short factors for sequences of at most `original_max_position_embeddings`
    tokens, long factors (at every position) for longer ones, one attention factor for both.

    A token is in the long regime when its position is past the limit (a decode token: its
    sequence is that long) or its prefill sequence is longer than the limit
    (`attn_metadata.prefill_seq_lens`; the scheduler recomputes a sequence whole when it crosses).
    """

    def __init__(self, short_inv_freq: torch.Tensor, long_inv_freq: torch.Tensor, attention_scaling: float,
                 original_max_positions: int) -> None:
        super().__init__(short_inv_freq, attention_scaling)
        self.register_buffer("long_inv_freq", long_inv_freq.to(torch.float32), persistent=False)
        self.original_max_positions = original_max_positions

    @classmethod
    def from_config(cls, hf_config: Any, device: torch.device | str | None = None) -> "LongRopeEmbedding":
        rotary_dim_of(hf_config)  # validates partial_rotary_factor
        original = long_context_threshold(hf_config, max_model_len=1 << 62)
        assert original is not None
        short, scaling = _transformers_inv_freq(hf_config, "longrope")
        long, long_scaling = _transformers_inv_freq(hf_config, "longrope", seq_len=original + 1)
        if long_scaling != scaling:
            raise ValueError(f"longrope: attention factors differ ({scaling} short, {long_scaling} long)")
        return cls(short.to(device), long.to(device), scaling, original)

    def forward(self, positions: torch.Tensor, attn_metadata: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        long = positions >= self.original_max_positions
        if attn_metadata is not None:
            for start, n, seq_len in zip(attn_metadata.prefill_query_starts, attn_metadata.prefill_query_lens,
                                         attn_metadata.prefill_seq_lens):
                if seq_len > self.original_max_positions:
                    long[start : start + n] = True
        cos_s, sin_s = self._cos_sin(positions, self.inv_freq)
        cos_l, sin_l = self._cos_sin(positions, self.long_inv_freq)
        pick = long[:, None]
        return torch.where(pick, cos_l, cos_s), torch.where(pick, sin_l, sin_s)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def apply_rotary_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `q [T, Hq, D]` and `k [T, Hk, D]` by `cos/sin [T, R]` (cast to q's dtype first):
    the first R <= D dimensions of each head (partial rotary), the rest pass through."""
    cos = cos.to(q.dtype).unsqueeze(1)
    sin = sin.to(q.dtype).unsqueeze(1)
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    q_rot, k_rot = q[..., :r], k[..., :r]
    return (torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q[..., r:]), dim=-1),
            torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k[..., r:]), dim=-1))


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
    rotary_dim = cos.shape[-1] if cos.dim() == 2 else -1
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[0] != tokens or not 0 < t.shape[1] <= head_dim or t.shape != cos.shape:
            raise ValueError(f"rotate_qkv: {name} {tuple(t.shape)} must be (tokens {tokens}, rotary dims <= head_dim "
                             f"{head_dim})")
    # The C kernel rotates whole heads; a partial rotary takes the torch path.
    kernel = fused_kernel_for(qkv, cos, sin) if rotary_dim == head_dim else None
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

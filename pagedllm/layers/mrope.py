"""Multimodal rotary position embedding (M-RoPE, Qwen2-VL / Qwen2.5-VL), as transformers'
`Qwen2VLRotaryEmbedding` computes it.

Each token has three positions (temporal, height, width); the head's `rotary_dim // 2`
frequencies are split into `mrope_section` = [t, h, w] consecutive groups and group i rotates by
axis i's position. Text tokens have the same position on all three axes, and then the result is
exactly plain RoPE at that position: so positions `[T]` take the parent's path unchanged (decode
steps, text-only prompts, the C decode step and compiled graphs all pass 1-D positions), and only
a prefill chunk that holds image tokens passes `[3, T]` (worker/mrope_positions.py).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers.rotary import RotaryEmbedding, _rope_params, compute_inv_freq


def mrope_section_of(hf_config: Any) -> list[int] | None:
    """The config's `mrope_section` (None: the model uses plain RoPE)."""
    _, scaling = _rope_params(hf_config)
    section = scaling.get("mrope_section")
    return [int(s) for s in section] if section else None


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE over positions `[T]` (all axes equal) or `[3, T]` (temporal, height, width)."""

    def __init__(self, inv_freq: torch.Tensor, mrope_section: list[int], attention_scaling: float = 1.0) -> None:
        super().__init__(inv_freq, attention_scaling)
        if sum(mrope_section) != inv_freq.numel() or len(mrope_section) != 3:
            raise ValueError(f"mrope_section {mrope_section} must be 3 parts summing to rotary_dim // 2 = "
                             f"{inv_freq.numel()} (the head's frequencies)")
        self.mrope_section = list(mrope_section)
        # axis of each frequency: [0]*t + [1]*h + [2]*w, for one gather instead of split + cat
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        self.register_buffer("freq_axis", axis.to(inv_freq.device), persistent=False)

    @classmethod
    def from_config(cls, hf_config: Any, device: torch.device | str | None = None) -> "MRotaryEmbedding":
        section = mrope_section_of(hf_config)
        if section is None:
            raise ValueError("MRotaryEmbedding needs rope_parameters['mrope_section'] in the config")
        theta_type = _rope_params(hf_config)[1]["rope_type"]
        if theta_type != "default":
            raise ValueError(f"M-RoPE with rope_type {theta_type!r} is not supported (only 'default')")
        inv_freq, scaling = compute_inv_freq(hf_config)
        return cls(inv_freq.to(device), section, scaling)

    def forward(self, positions: torch.Tensor, attn_metadata: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return self._cos_sin(positions, self.inv_freq)
        if positions.dim() != 2 or positions.shape[0] != 3:
            raise ValueError(f"M-RoPE positions must be [tokens] or [3, tokens], got {tuple(positions.shape)}")
        # freqs[a, t, f] = positions[a, t] * inv_freq[f]; frequency f takes its section's axis
        freqs = positions[..., None].float() * self.inv_freq[None, None, :]
        index = self.freq_axis.view(1, 1, -1).expand(1, freqs.shape[1], -1)
        freqs = freqs.gather(0, index)[0]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

"""Qwen3 (dense): Llama's decoder with a per-head RMSNorm on q and k before rotary.

What differs from Qwen2 (model/llama.py), as transformers' `Qwen3Attention` computes it: `q_norm`
and `k_norm` (RMSNorm over `head_dim`, one weight shared by all heads) are applied to each head
of the projected queries and keys before the rotary embedding; q/k/v/o carry a bias only when
`attention_bias` is set (none in the released checkpoints); `head_dim` is explicit in the config
(128 in every Qwen3, not hidden / heads). Sliding-window layers follow `layer_types`.

The normed heads are written back into the fused projection's buffer so that the in-place C
rotary kernel (`rotate_qkv`) still applies. Under tensor parallelism the norms' weights are
per head dimension and replicated on every rank; nothing else changes.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.norm import RMSNorm
from pagedllm.quantization.formats.base import QuantizationConfig
from pagedllm.layers.rotary import rotate_qkv
from pagedllm.model.llama import SINGLE, KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen3Attention(LlamaAttention):
    """Llama attention with `q_norm` / `k_norm` on every head before rotary."""

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype, device: torch.device | str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__(config, layer_idx, dtype, device, quant_config, prefix, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        tokens, d = qkv.shape[0], self.head_dim
        q = qkv[:, : self.q_size]
        k = qkv[:, self.q_size : self.q_size + self.kv_size]
        q.copy_(self.q_norm(q.reshape(tokens * self.num_heads, d)).view(tokens, self.q_size))
        k.copy_(self.k_norm(k.reshape(tokens * self.num_kv_heads, d)).view(tokens, self.kv_size))
        q, k, v = rotate_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads, d)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense causal LM (`Qwen3ForCausalLM`)."""

    model_cls = Qwen3Model

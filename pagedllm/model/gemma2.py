"""Gemma 2 (`Gemma2ForCausalLM`): Llama's decoder with Gemma's norms, scales and soft caps.

What differs from Llama (model/llama.py), as transformers 5.24's `modeling_gemma2.py` computes it:
- RMSNorm with `(1 + weight)`, computed in float32 and multiplied before the downcast
  (layers/norm.py `GemmaRMSNorm`), and four of them per layer: the attention and the MLP each
  sit between a pre-norm and a post-norm (`input_layernorm` / `post_attention_layernorm`,
  `pre_feedforward_layernorm` / `post_feedforward_layernorm`); the residual is added after the
  post-norm. The `(output, residual)` convention still holds: a pre-norm fuses the residual add.
- The embedding is multiplied by sqrt(hidden_size) rounded to the model's dtype (HF's
  `embed_scale` buffer cast to the weight's dtype: 55.4256 becomes 55.5 in bfloat16).
- GELU-tanh gated MLP (`hidden_activation: gelu_pytorch_tanh`).
- Attention scale `query_pre_attn_scalar ** -0.5` (not head_dim's), and attention logit
  soft-capping `attn_logit_softcapping * tanh(scores / cap)` in every backend.
- Sliding-window layers alternate with global ones (`layer_types`; layer_sliding_window).
- Final logit soft-capping (`final_logit_softcapping`) in `compute_logits`, in the model's
  dtype as transformers does it, then float32 for the sampler.
- The LM head is tied to the embedding (`tie_word_embeddings`, every released Gemma 2).

Sliding layers keep only their window's blocks (the hybrid KV cache, docs/hybrid_kv_cache.md;
docs/gemma.md: what keeping them all costs). `use_bidirectional_attention` (an encoder use of the checkpoint) is refused.
Tensor parallelism is Llama's: heads, intermediate size and vocabulary split, norms replicated.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.activation import soft_cap
from pagedllm.layers.attention import AttentionMetadata, check_soft_cap
from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.quantization.formats.base import QuantizationConfig
from pagedllm.model.llama import (
    SINGLE,
    KVCache,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)

RotaryTables = list[tuple[torch.Tensor, torch.Tensor]]  # (cos, sin) of each layer


def check_gemma_config(config: Any) -> None:
    """ValueError for the Gemma variants this decoder does not compute."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{config.model_type}: use_bidirectional_attention=True (bidirectional, encoder-style "
                         "attention) is not supported: pagedllm generates with causal attention only")
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ValueError(f"{config.model_type}: query_pre_attn_scalar must be a positive number, got {scalar!r}")


def set_gemma_attention(attention: LlamaAttention, config: Any, logits_soft_cap: float | None) -> None:
    """Gemma's attention scale (`query_pre_attn_scalar ** -0.5`) and soft cap on a Llama
    attention block's `Attention` layer."""
    attention.attn.scale = float(config.query_pre_attn_scalar) ** -0.5
    attention.attn.logits_soft_cap = check_soft_cap(logits_soft_cap)


class GemmaMLP(LlamaMLP):
    """Llama's gated MLP with Gemma's activation (`hidden_activation`, GELU-tanh)."""

    @staticmethod
    def activation(config: Any) -> str:
        return getattr(config, "hidden_activation", None) or config.hidden_act


class Gemma2Attention(LlamaAttention):
    """Llama attention with Gemma 2's scale and attention logit soft-capping."""

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype, device: torch.device | str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__(config, layer_idx, dtype, device, quant_config, prefix, tp)
        set_gemma_attention(self, config, getattr(config, "attn_logit_softcapping", None))


class Gemma2DecoderLayer(LlamaDecoderLayer):
    """Pre- and post-norms around attention and around the MLP (four GemmaRMSNorms)."""

    attention_cls = Gemma2Attention
    norm_cls = GemmaRMSNorm

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype, device: torch.device | str,
                 quant_config: QuantizationConfig | None = None, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__(config, layer_idx, dtype, device, quant_config, tp)
        eps = config.rms_norm_eps
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps, dtype=dtype, device=device)

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype, device: torch.device | str,
                 quant_config: QuantizationConfig | None, prefix: str, tp: TensorParallelGroup) -> GemmaMLP:
        return GemmaMLP(config, dtype, device, quant_config, prefix, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(output, residual)` as Llama's layer: the output is `output + residual`, added by the
        next pre-norm. transformers: `h = r + post_attn(attn(in(r))); out = h + post_ff(mlp(pre_ff(h)))`."""
        first = residual is None  # the first layer: the embedding is the residual
        hidden, residual = (self.input_layernorm(hidden), hidden) if first else self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, cos, sin, kv_cache, attn_metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2Model(LlamaModel):
    layer_cls = Gemma2DecoderLayer
    norm_cls = GemmaRMSNorm

    def rotary_tables(self, positions: torch.Tensor, attn_metadata: AttentionMetadata) -> RotaryTables:
        """Each layer's `(cos, sin)` for this step (Gemma 2: one table for all layers)."""
        table = self.rotary_emb(positions, attn_metadata)
        return [table] * len(self.layers)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 causal LM: scaled embedding, Gemma layers, soft-capped logits."""

    model_cls = Gemma2Model

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 quant_config: QuantizationConfig | None = None, tp: TensorParallelGroup = SINGLE) -> None:
        check_gemma_config(config)
        super().__init__(config, dtype, device, quant_config, tp)
        # HF: a float32 buffer sqrt(hidden) cast to the weight's dtype, times the looked-up rows.
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5).to(dtype))
        self.final_logit_softcapping = check_soft_cap(getattr(config, "final_logit_softcapping", None))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Gemma scales its embedding by sqrt(hidden size) (an image's rows are not scaled)."""
        return self.model.embed_tokens(input_ids) * self.embed_scale

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        tables = self.model.rotary_tables(positions, attn_metadata)
        residual = None
        for layer, kv_cache, (cos, sin) in zip(self.model.layers, kv_caches, tables, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, attn_metadata)
        return self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits, soft-capped by `final_logit_softcapping` in the model's dtype (as
        transformers caps its head's output); rank 0 only under tensor parallelism."""
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if logits is None or cap is None:
            return logits
        return soft_cap(logits.to(self.dtype), cap).float()

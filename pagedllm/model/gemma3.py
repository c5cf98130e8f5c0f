"""Gemma 3, text only (`Gemma3ForCausalLM`, model_type `gemma3_text`): Gemma 2 (model/gemma2.py)
with q/k norms and a rotary table per layer type.

What differs from Gemma 2, as transformers 5.24's `modeling_gemma3.py` computes it:
- `q_norm` / `k_norm`: a Gemma `(1 + weight)` RMSNorm over `head_dim` on every query and key
  head after the projection, before rotary (Qwen3's placement, model/qwen3.py, Gemma's norm).
- Local / global rope: sliding-window layers rotate with `rope_parameters["sliding_attention"]`
  (`rope_local_base_freq`, 10k), full-attention layers with `rope_parameters["full_attention"]`
  (1M, with the checkpoint's `rope_scaling`, e.g. linear x8 in 4B / 12B / 27B): two tables
  per step, each layer taking its type's.
- The layer pattern: `layer_types` (from `sliding_window_pattern`, 6 by default: five sliding
  layers, then a global one).
- No attention logit soft-capping: transformers' `Gemma3Attention` does not pass
  `attn_logit_softcapping` to its attention (the released configs have none), so neither does
  this model. `final_logit_softcapping` is applied when set, as in Gemma 2.

`Gemma3ForConditionalGeneration` (the multimodal 4B / 12B / 27B checkpoints, model_type
`gemma3`) runs this text model with transformers' SigLIP tower and projector beside it
(model/vision_gemma3.py, model/multimodal.py; docs/multimodal.md "Gemma 3"): image rows
replace the scaled text embedding at their placeholders, and prefill attends bidirectionally
inside each image block (`AttentionMetadata.prefill_bidirectional_spans`).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.quantization.formats.base import QuantizationConfig
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.model.gemma2 import (
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    Gemma2Model,
    RotaryTables,
    set_gemma_attention,
)
from pagedllm.model.llama import SINGLE
from pagedllm.model.qwen3 import Qwen3Attention

LAYER_TYPES = ("full_attention", "sliding_attention")


class RopeView:
    """The config as one layer type's rotary embedding reads it: `rope_parameters` is that
    type's dict (`rope_type`, `rope_theta`, scaling keys); every other attribute is the config's."""

    def __init__(self, config: Any, layer_type: str) -> None:
        params = getattr(config, "rope_parameters", None)
        if not isinstance(params, dict) or not isinstance(params.get(layer_type), dict):
            raise ValueError(f"gemma3_text: rope_parameters must hold one dict per layer type {list(LAYER_TYPES)}, "
                             f"got {params!r}")
        self._config = config
        self.rope_parameters = dict(params[layer_type])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class Gemma3Attention(Qwen3Attention):
    """Qwen3's q/k-normed attention with Gemma's norms and scale (no soft cap, as transformers)."""

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype, device: torch.device | str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__(config, layer_idx, dtype, device, quant_config, prefix, tp)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
        set_gemma_attention(self, config, None)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3Model(Gemma2Model):
    """Gemma 2's model with a global (`rotary_emb`) and a local (`rotary_emb_local`) rotary table."""

    layer_cls = Gemma3DecoderLayer

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device | str,
                 quant_config: QuantizationConfig | None = None, tp: TensorParallelGroup = SINGLE) -> None:
        unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
        if len(config.layer_types) != config.num_hidden_layers or unknown:
            raise ValueError(f"gemma3_text: layer_types must name {config.num_hidden_layers} layers, each one of "
                             f"{list(LAYER_TYPES)}; got {config.layer_types!r}")
        super().__init__(config, dtype, device, quant_config, tp)
        self.rotary_emb = RotaryEmbedding.from_config(RopeView(config, "full_attention"), device=device)
        self.rotary_emb_local = RotaryEmbedding.from_config(RopeView(config, "sliding_attention"), device=device)
        self.layer_types = list(config.layer_types)

    def rotary_tables(self, positions: torch.Tensor, attn_metadata: AttentionMetadata) -> RotaryTables:
        """Each layer's `(cos, sin)`: the local table for sliding layers, the global one else."""
        tables = {"full_attention": self.rotary_emb(positions, attn_metadata),
                  "sliding_attention": self.rotary_emb_local(positions, attn_metadata)}
        return [tables[t] for t in self.layer_types]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text causal LM (`Gemma3ForCausalLM`)."""

    model_cls = Gemma3Model

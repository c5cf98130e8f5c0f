"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v bias from `qkv_bias`, none on o), and sparse
feed-forward blocks with a shared expert.

A layer is sparse unless it is listed in `mlp_only_layers` or `(layer + 1) % decoder_sparse_step`
is not 0; the others keep a dense MLP of `intermediate_size`. A sparse block routes each token to
`num_experts_per_tok` of `num_experts` experts of `moe_intermediate_size` (softmax over all in
float32, top k, renormalised only with `norm_topk_prob`, the weights cast to the hidden dtype),
and adds the shared expert (`shared_expert_intermediate_size`) scaled by
`sigmoid(shared_expert_gate(x))`, as transformers 5.24's `Qwen2MoeSparseMoeBlock` (layers/moe.py).
Checkpoint names are transformers' (`mlp.gate`, `mlp.experts.E.gate_proj`, `mlp.shared_expert.*`,
`mlp.shared_expert_gate`); the fused form (`mlp.experts.gate_up_proj [E, 2I, H]`) is split per expert.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.moe import MoeCheckpointMixin, MoeSpec, SparseMoeBlock
from pagedllm.quantization.formats.base import QuantizationConfig
from pagedllm.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether layer `layer_idx` is a mixture of experts (transformers' rule), else a dense MLP."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)


class Qwen2MoeAttention(LlamaAttention):
    @staticmethod
    def projection_biases(config: Any) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2MoeAttention
    shared_expert = True  # Qwen2-MoE's blocks have one; Qwen3-MoE's do not

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        return MoeSpec(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                       intermediate_size=config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                       float32_weights=False,
                       shared_expert_size=config.shared_expert_intermediate_size if cls.shared_expert else None)

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype, device: torch.device | str,
                 quant_config: QuantizationConfig | None, prefix: str, tp: TensorParallelGroup) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return SparseMoeBlock(config, self.moe_spec(config), dtype, device, quant_config, prefix, tp)
        return LlamaMLP(config, dtype, device, quant_config, prefix, tp)


class Qwen2MoeModel(LlamaModel):
    layer_cls = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(MoeCheckpointMixin, LlamaForCausalLM):
    """Qwen2-MoE causal LM (`Qwen2MoeForCausalLM`)."""

    model_cls = Qwen2MoeModel

    @classmethod
    def tp_split_sizes(cls, config: Any) -> dict[str, int]:
        sparse = [is_sparse_layer(config, i) for i in range(config.num_hidden_layers)]
        sizes = {}
        if any(sparse):
            spec = cls.model_cls.layer_cls.moe_spec(config)
            sizes["each expert's intermediate size (moe_intermediate_size)"] = spec.intermediate_size
            if spec.shared_expert_size:
                sizes["the shared expert's intermediate size"] = spec.shared_expert_size
        if not all(sparse):
            sizes["the dense layers' intermediate size"] = config.intermediate_size
        return sizes

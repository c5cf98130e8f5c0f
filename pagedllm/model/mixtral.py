"""Mixtral: Llama's attention and decoder layer, the feed-forward a sparse block of experts.

Each layer's `block_sparse_moe` routes every token to `num_experts_per_tok` (2) of
`num_local_experts` (8) experts: softmax over all experts in float32, top 2, renormalised,
the expert outputs scaled by the float32 weights (layers/moe.py; transformers 5.24's
`MixtralSparseMoeBlock`). Our parameter names are transformers 5's in-memory ones
(`model.layers.N.mlp.gate`, `mlp.experts.E.gate_up_proj`, `mlp.experts.E.down_proj`); the Hub's
checkpoint names (`block_sparse_moe.gate`, `block_sparse_moe.experts.E.w1 / w3 / w2`) are renamed
on load, and transformers' fused form (`mlp.experts.gate_up_proj [E, 2I, H]`) is split per expert.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.moe import MoeCheckpointMixin, MoeSpec, SparseMoeBlock
from pagedllm.quantization.formats.base import QuantizationConfig
from pagedllm.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pagedllm.model.llama_checkpoint import _checkpoint_name

_HUB_TO_OURS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_OURS_TO_HUB = {v: k for k, v in _HUB_TO_OURS.items()}
_HUB_EXPERT = re.compile(r"(\.experts\.\d+\.)(w[123])\.")
_OUR_EXPERT = re.compile(r"(\.experts\.\d+\.)(gate_proj|up_proj|down_proj)\.")


def mixtral_spec(config: Any) -> MoeSpec:
    return MoeSpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                   intermediate_size=config.intermediate_size, renormalize=True, float32_weights=True,
                   checkpoint_names=("w1", "w3", "w2"), checkpoint_block="block_sparse_moe")


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype, device: torch.device | str,
                 quant_config: QuantizationConfig | None, prefix: str, tp: TensorParallelGroup) -> nn.Module:
        return SparseMoeBlock(config, mixtral_spec(config), dtype, device, quant_config, prefix, tp)


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(MoeCheckpointMixin, LlamaForCausalLM):
    """Mixtral causal LM (`MixtralForCausalLM`)."""

    model_cls = MixtralModel

    def to_model_name(self, name: str) -> str:
        """`model.layers.0.block_sparse_moe.experts.3.w1.weight` -> `model.layers.0.mlp.experts.3.gate_proj.weight`."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return _HUB_EXPERT.sub(lambda m: f"{m[1]}{_HUB_TO_OURS[m[2]]}.", name)

    @staticmethod
    def to_checkpoint_name(name: str) -> str:
        """The inverse of `to_model_name`: the Hub's spelling of one of our tensors."""
        name = name.replace(".mlp.", ".block_sparse_moe.")
        return _OUR_EXPERT.sub(lambda m: f"{m[1]}{_OURS_TO_HUB[m[2]]}.", name)

    def checkpoint_name(self, name: str, shard: int | None) -> str:
        hub = self.to_checkpoint_name(name if shard is None else _checkpoint_name(name, shard))
        if shard is not None:
            return f"{name}[shard {shard}] ({hub})"
        return name if hub == name else f"{name} ({hub})"

    @classmethod
    def tp_split_sizes(cls, config: Any) -> dict[str, int]:
        return {"each expert's intermediate size": config.intermediate_size}

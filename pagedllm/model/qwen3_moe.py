"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm before rotary, bias only with
`attention_bias`, explicit `head_dim`; model/qwen3.py) and Qwen2-MoE's sparse blocks without the
shared expert (model/qwen2_moe.py): top `num_experts_per_tok` of `num_experts`, renormalised
with `norm_topk_prob` (true in the released checkpoints), dense MLPs in `mlp_only_layers` and
off the `decoder_sparse_step`.
"""

from __future__ import annotations

from pagedllm.model.llama import LlamaModel
from pagedllm.model.qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeForCausalLM
from pagedllm.model.qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention_cls = Qwen3Attention
    shared_expert = False


class Qwen3MoeModel(LlamaModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE causal LM (`Qwen3MoeForCausalLM`)."""

    model_cls = Qwen3MoeModel

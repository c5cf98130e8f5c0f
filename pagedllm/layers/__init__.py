"""Model building blocks: linear layers, norms, activations, rotary embedding, paged attention."""

from pagedllm.layers.activation import SiluAndMul, get_act_and_mul
from pagedllm.layers.attention import Attention, AttentionMetadata
from pagedllm.layers.linear import Linear, MergedLinear, VocabEmbedding
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary_emb, compute_inv_freq

__all__ = [
    "Attention",
    "AttentionMetadata",
    "Linear",
    "MergedLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "VocabEmbedding",
    "apply_rotary_emb",
    "compute_inv_freq",
    "get_act_and_mul",
]

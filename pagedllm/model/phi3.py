"""Phi-3 / Phi-4-mini (`Phi3ForCausalLM`): Llama's decoder with fused checkpoint projections.

What differs from Llama, as transformers' `modeling_phi3.py` computes it:
- The checkpoint stores q/k/v as one `self_attn.qkv_proj` and gate/up as one `mlp.gate_up_proj`
  (rows `[q | k | v]` and `[gate | up]`, the layout of our fused layers). `load_weights` cuts
  them into the per-projection tensors the Llama loader takes, so sharding (each rank's heads
  and intermediate slice) and the missing / unexpected / shape checks are the Llama ones.
- `longrope` rope scaling (Phi-3-*-128k, Phi-3.5, Phi-4-mini) with short and long factors
  chosen by the sequence's length (layers/rotary.py `LongRopeEmbedding`; the scheduler
  recomputes a sequence that grows past `original_max_position_embeddings`), and
  `partial_rotary_factor` (Phi-4-mini: 0.75 of each head is rotated).
- `sliding_window` (Phi-3-mini-4k: 2047) on every layer.

Quantized Phi-3 checkpoints (GPTQ / AWQ / GGUF) pack the fused projections in formats whose
cutting is not implemented: refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.quantization.formats.base import QuantizationConfig
from pagedllm.model.llama import SINGLE, LlamaForCausalLM
from pagedllm.layers.rotary import head_dim_of

# checkpoint module -> the modules its rows stand for, in order
_FUSED_IN_CHECKPOINT = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 causal LM: the Llama model with Phi-3's checkpoint layout and rope."""

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 quant_config: QuantizationConfig | None = None, tp: TensorParallelGroup = SINGLE) -> None:
        if quant_config is not None:
            raise ValueError(f"Quantized Phi-3 checkpoints ({type(quant_config).__name__}) are not supported: "
                             "their fused qkv_proj / gate_up_proj would have to be cut in the packed format")
        super().__init__(config, dtype, device, None, tp)

    def _fused_sizes(self, module: str) -> list[int]:
        """Row counts of the checkpoint's fused `module` (whole-model sizes, not this rank's)."""
        c = self.config
        if module == "qkv_proj":
            d = head_dim_of(c)
            kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
            return [c.num_attention_heads * d, kv_heads * d, kv_heads * d]
        return [c.intermediate_size, c.intermediate_size]

    @staticmethod
    def _fused_parts(name: str) -> tuple[str, str, str] | None:
        """`model.layers.0.self_attn.qkv_proj.weight` -> (prefix, `qkv_proj`, `weight`); None otherwise."""
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED_IN_CHECKPOINT:
            return ".".join(parts[:-2]), parts[-2], parts[-1]
        return None

    def checkpoint_slices(self, name: str, shape: tuple[int, ...] | None = None) -> list[tuple[int, int, int]]:
        if self._fused_parts(name) is not None:
            return []  # read whole: `load_weights` cuts each part and this rank's rows of it
        return super().checkpoint_slices(name, shape)

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            fused = self._fused_parts(name)
            if fused is None:
                yield name, tensor
                continue
            prefix, module, leaf = fused
            sizes = self._fused_sizes(module)
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"Shape mismatch loading {name}: checkpoint has {tuple(tensor.shape)}, "
                                 f"model expects {sum(sizes)} rows ({' + '.join(map(str, sizes))})")
            for part_name, part in zip(_FUSED_IN_CHECKPOINT[module], tensor.split(sizes, dim=0)):
                full = f"{prefix}.{part_name}.{leaf}"
                for dim, start, length in self.checkpoint_slices(full, tuple(part.shape)):
                    part = part.narrow(dim, start, length)  # this rank's rows / columns
                yield full, part

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Llama's loader, the fused `qkv_proj` / `gate_up_proj` first cut into their parts."""
        super().load_weights(self._split_fused(weights))

"""A loaded LoRA adapter (`LoRAAdapter`) and one tensor-parallel rank's part of it.

Every projection's delta is stored factored, `W' = W + B @ A`, as float32 `A [r, in]` and
`B [out, r]` with the module's scaling (`lora_alpha / r`, or `/ sqrt(r)` for rsLoRA) already
multiplied into B, so the kernels compute `y += (x @ A^T) @ B^T` with no per-adapter scalar.
Keys are `(layer index, projection name)` with the per-projection names q_proj ... down_proj,
also for checkpoints whose adapters fuse them (Phi-3: B's rows already split).

`shard_adapter` cuts an adapter as the base layers are cut (`model_spec.tp_range`):
column-parallel q/k/v and gate/up keep B's rows of the rank's output features (A whole: every
rank sees the whole input); row-parallel o / down keep A's columns of the rank's input features
(B whole: the partial products are summed by the layer's all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.lora.model_spec import LoRAModelSpec, tp_range


@dataclass(frozen=True)
class LoRALayerWeights:
    lora_a: torch.Tensor  # [r, in_features] float32
    lora_b: torch.Tensor  # [out_features, r] float32, scaling folded in
    scaling: float  # the factor already in lora_b (kept for reports)

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    def delta(self) -> torch.Tensor:
        """The dense weight update `B @ A` `[out, in]` (tests and merging; serving keeps it factored)."""
        return self.lora_b @ self.lora_a


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    lora_int_id: int
    rank: int  # the largest rank of its projections (slots are sized by max_lora_rank)
    scaling: float  # the config's default scaling; per-projection values (alpha/rank patterns) are in B
    weights: dict[tuple[int, str], LoRALayerWeights]

    def get(self, layer: int, module: str) -> LoRALayerWeights | None:
        """The projection's weights; None where the adapter leaves it unchanged."""
        return self.weights.get((layer, module))


def shard_adapter(adapter: LoRAAdapter, spec: LoRAModelSpec, rank: int, world: int) -> LoRAAdapter:
    """Rank `rank`'s part of `adapter` of `world` ranks (views of the adapter's tensors)."""
    if world == 1:
        return adapter
    weights = {}
    for (layer, module), w in adapter.weights.items():
        start, length = tp_range(spec, module, rank, world)
        if spec.modules[module].parallel == "column":
            weights[layer, module] = LoRALayerWeights(w.lora_a, w.lora_b.narrow(0, start, length), w.scaling)
        else:
            weights[layer, module] = LoRALayerWeights(w.lora_a.narrow(1, start, length), w.lora_b, w.scaling)
    return LoRAAdapter(adapter.name, adapter.lora_int_id, adapter.rank, adapter.scaling, weights)

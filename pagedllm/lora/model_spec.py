"""What a model offers to LoRA: its projections' names, full sizes and tensor-parallel split.

The adapter loader needs only names and full (unsharded) sizes, not a built model, so a model
describes itself with a `LoRAModelSpec`: per projection (q/k/v/o/gate/up/down, the names every
Llama-family checkpoint and PEFT adapter use) its input / output features, which of pagedllm's
fused layers computes it (`qkv_proj` slices 0-2, `o_proj`, `gate_up_proj` slices 0-1,
`down_proj`: model/llama_checkpoint.py's `_STACKED_PARAMS`) and how tensor parallelism splits it.
Phi-3's checkpoint (so its adapters) fuses q/k/v and gate/up: `checkpoint_modules` maps such a
fused name to the projections whose rows it stacks.

`tp_range` is the base layers' tensor-parallel split of each projection (distributed/sharding.py),
which `adapter.shard_adapter` applies to an adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.distributed.sharding import head_shard, shard_range
from pagedllm.layers.rotary import head_dim_of
from pagedllm.model.registry import architecture_of

# Mixture-of-experts models: LoRA on experts (per-expert A / B, routed) is not built.
_MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# Checkpoints that store q/k/v and gate/up fused (model/phi3.py), so adapters target those names.
_FUSED_CHECKPOINTS = {"Phi3ForCausalLM": {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                          "gate_up_proj": ("gate_proj", "up_proj")}}


@dataclass(frozen=True)
class LoRAModuleSpec:
    """One projection of a decoder layer, in full (unsharded) sizes."""

    name: str  # q_proj ... down_proj: the key of the adapter's A / B
    block: str  # "self_attn" | "mlp": where it sits (`model.layers.N.<block>.<name>`)
    fused_module: str  # pagedllm's layer that computes it: qkv_proj, o_proj, gate_up_proj, down_proj
    slice_index: int | None  # its part of the fused layer's output; None: the whole layer
    in_features: int
    out_features: int
    parallel: str  # "column" (output features split) | "row" (input features split)


@dataclass(frozen=True)
class LoRAModelSpec:
    """A model's LoRA-capable projections (`modules`, by projection name) and layer count."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    modules: dict[str, LoRAModuleSpec]
    # the module names adapters of this checkpoint target -> the projections whose B rows they stack
    checkpoint_modules: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def module_key(self, layer: int, checkpoint_module: str) -> str:
        """transformers' module name, as PEFT matches `target_modules` against it."""
        block = self.modules[self.checkpoint_modules[checkpoint_module][0]].block
        return f"model.layers.{layer}.{block}.{checkpoint_module}"

    def checkpoint_out_features(self, checkpoint_module: str) -> list[int]:
        """Row counts of the parts a checkpoint module's B stacks (one part for an unfused one)."""
        return [self.modules[p].out_features for p in self.checkpoint_modules[checkpoint_module]]


def lora_model_spec(config: Any) -> LoRAModelSpec:
    """The spec of a Llama-family config (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3); ValueError
    for a mixture-of-experts model."""
    arch = architecture_of(config)
    if arch in _MOE_ARCHITECTURES:
        raise ValueError(f"LoRA adapters on mixture-of-experts models ({arch}) are not supported: "
                         "per-expert adapters are not built")
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    d = head_dim_of(config)
    parts = [("q_proj", "self_attn", "qkv_proj", 0, hidden, heads * d, "column"),
             ("k_proj", "self_attn", "qkv_proj", 1, hidden, kv_heads * d, "column"),
             ("v_proj", "self_attn", "qkv_proj", 2, hidden, kv_heads * d, "column"),
             ("o_proj", "self_attn", "o_proj", None, heads * d, hidden, "row"),
             ("gate_proj", "mlp", "gate_up_proj", 0, hidden, inter, "column"),
             ("up_proj", "mlp", "gate_up_proj", 1, hidden, inter, "column"),
             ("down_proj", "mlp", "down_proj", None, inter, hidden, "row")]
    modules = {p[0]: LoRAModuleSpec(*p) for p in parts}
    fused = _FUSED_CHECKPOINTS.get(arch, {})
    in_fused = {p for names in fused.values() for p in names}
    checkpoint = {name: (name,) for name in modules if name not in in_fused}
    checkpoint.update(fused)
    return LoRAModelSpec(arch, config.num_hidden_layers, heads, kv_heads, d, modules, checkpoint)


def tp_range(spec: LoRAModelSpec, module: str, rank: int, world: int) -> tuple[int, int]:
    """(start, length) of rank `rank`'s features of `module`: output features of a column-parallel
    projection (its heads for q / k / v, KV heads replicated when fewer than ranks), input
    features of a row-parallel one; the base layers' split (model/llama.py)."""
    m = spec.modules[module]
    d = spec.head_dim
    if m.fused_module == "qkv_proj":
        q, kv = head_shard(spec.num_heads, spec.num_kv_heads, rank, world)
        first, count = q if module == "q_proj" else kv
        return first * d, count * d
    size = m.out_features if m.parallel == "column" else m.in_features
    return shard_range(size, rank, world, "the attention output" if module == "o_proj" else "the intermediate size")


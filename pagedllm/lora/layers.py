"""LoRA on the model's linear layers: per-layer adapter slots and the step's token indices.

Every target projection (q/k/v, o, gate/up, down of each decoder layer) gets a `LoRALinear`
holding `max_loras` adapter *slots* as two stacked tensors (vLLM's `lora_a_stacked` /
`lora_b_stacked`):

- `a [max_loras, n_slices * max_rank, in]`: each slice's A (rank rows, zero-padded to
  `max_rank`), one slice per projection a fused layer stands for (q, k, v: 3; gate, up: 2);
- `b [max_loras, out, max_rank]`: each slice's B (scaling folded in) in its output rows.

`LoRALinear.add_to(x, y)` adds `expand(shrink(x))` for the step's tokens in place: one
`lora_shrink` and one `lora_expand` call for the whole batch, whatever adapters it mixes
(lora/ops.py: the C kernel on CPU, Triton on CUDA; a token whose index is -1 runs the base
model only). The indices live in one `LoRAStepContext` that every layer of the model shares
and the runner sets before each forward (vLLM's PunicaWrapper plays that role).

Tensor parallelism: a slot holds this rank's part (lora/adapter.shard_adapter, cut as the base
layers are): column-parallel layers (qkv, gate/up) keep A whole and their rows of B; row-parallel
ones (o, down) keep their input columns of A and B whole, and the shrink's partial sums are
added over the ranks (one all-reduce of `[tokens, rank]` floats) before the expand, so every
rank adds the same delta to the all-reduced output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.distributed import parallel_state
from pagedllm.layers.linear import Linear, RowParallelLinear

# Our module names per decoder layer -> the checkpoint (PEFT) projections each stands for, in
# its slice order. Phi-3 checkpoints name the fused ones themselves (one slice each there).
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


@dataclass
class LoRAStepContext:
    """The step's adapter slot per token (`indices [T]` int32, -1: base model), shared by every
    LoRA layer of one model; `active` False when no token of the step uses an adapter (the
    layers then skip the LoRA ops)."""

    indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))
    active: bool = False

    def set(self, indices: torch.Tensor) -> None:
        self.indices = indices
        self.active = bool(indices.numel()) and bool((indices >= 0).any())


class LoRALinear:
    """The adapter slots of one (possibly fused) linear layer of this rank (a plain object, not
    a module: its tensors are no checkpoint state)."""

    def __init__(self, layer: Linear, max_loras: int, max_rank: int, context: LoRAStepContext) -> None:
        self.context = context
        self.max_rank = max_rank
        self.slice_sizes = list(layer.output_sizes)  # this rank's rows of each slice
        self.row_parallel = isinstance(layer, RowParallelLinear)
        device = next((p.device for p in layer.parameters()), torch.device("cpu"))
        n = len(self.slice_sizes)
        self.a = torch.zeros(max_loras, n * max_rank, layer.input_size, dtype=torch.float32, device=device)
        self.b = torch.zeros(max_loras, layer.output_size, max_rank, dtype=torch.float32, device=device)

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter into `slot`: per slice, this rank's `(A [r, in], B [out, r])`
        (lora/adapter.shard_adapter's cut) or None (the adapter leaves that projection alone)."""
        if len(parts) != len(self.slice_sizes):
            raise ValueError(f"{len(parts)} LoRA slices for a layer of {len(self.slice_sizes)}")
        self.a[slot].zero_()
        self.b[slot].zero_()
        row = 0
        for i, (part, size) in enumerate(zip(parts, self.slice_sizes)):
            if part is not None:
                a, b = part
                r = a.shape[0]
                if r > self.max_rank:
                    raise ValueError(f"an adapter of rank {r} does not fit max_lora_rank={self.max_rank}")
                self.a[slot, i * self.max_rank : i * self.max_rank + r].copy_(a)
                self.b[slot, row : row + size, :r].copy_(b)
            row += size

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y += B_slot (A_slot x)` per token, in place (`x [T, in]`, `y [T, out]`)."""
        from pagedllm.lora.ops import lora_expand, lora_shrink

        ctx = self.context
        if not ctx.active:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float32:
            x2 = x2.float()
        buf = lora_shrink(x2.contiguous(), self.a, ctx.indices)
        if self.row_parallel:
            buf = parallel_state.all_reduce_sum(buf)
        if y.dtype == torch.float32 and y.is_contiguous():
            lora_expand(buf, self.b, ctx.indices, y.view(-1, y.shape[-1]), self.slice_sizes)
            return y
        delta = torch.zeros(y.numel() // y.shape[-1], y.shape[-1], dtype=torch.float32, device=y.device)
        lora_expand(buf, self.b, ctx.indices, delta, self.slice_sizes)
        return y.add_(delta.view_as(y).to(y.dtype))


def lora_layers(model: nn.Module) -> dict[tuple[int, str], Linear]:
    """The model's target projections by (decoder layer index, our module name)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers to put LoRA adapters on")
    out: dict[tuple[int, str], Linear] = {}
    for i, layer in enumerate(layers):
        for name in LORA_TARGETS:
            module = layer.get_submodule(name) if _has(layer, name) else None
            if isinstance(module, Linear):
                out[(i, name)] = module
    return out


def _has(module: nn.Module, dotted: str) -> bool:
    try:
        module.get_submodule(dotted)
    except AttributeError:
        return False
    return True


def attach_lora(model: nn.Module, max_loras: int, max_rank: int) -> tuple[LoRAStepContext, dict[tuple[int, str], LoRALinear]]:
    """Give every target projection of `model` its adapter slots (`layer.lora`); the shared
    step context and the slots by (layer index, module name)."""
    context = LoRAStepContext()
    slots: dict[tuple[int, str], LoRALinear] = {}
    for key, layer in lora_layers(model).items():
        if getattr(layer, "lora", None) is not None:
            raise ValueError(f"layer {key} already has LoRA slots")
        layer.lora = LoRALinear(layer, max_loras, max_rank, context)
        slots[key] = layer.lora
    if not slots:
        raise ValueError(f"{type(model).__name__}: no projection LoRA can target (q/k/v, o, gate/up, down)")
    return context, slots

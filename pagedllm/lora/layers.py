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
from pagedllm.lora.ops import expand_dispatch, shrink_dispatch

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
    lo: int = -1  # the indices' range, read once a step for every layer's ops
    hi: int = -1

    def set(self, indices: torch.Tensor, num_slots: int) -> None:
        self.indices = indices
        if not indices.numel():
            self.lo = self.hi = -1
        else:
            lo, hi = torch.aminmax(indices)
            self.lo, self.hi = int(lo), int(hi)
        if self.lo < -1 or self.hi >= num_slots:
            raise ValueError(f"LoRA slot indices must lie in -1..{num_slots - 1}, got {self.lo}..{self.hi}")
        self.active = self.hi >= 0


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
        ctx = self.context
        if not ctx.active:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float32:
            x2 = x2.float()
        # shapes are this layer's by construction and the indices' range was read once for the
        # step (LoRAStepContext.set): the ops' dispatch, without their per-call checks
        buf = shrink_dispatch(x2, self.a, ctx.indices, x2.new_empty(x2.shape[0], self.a.shape[1]), ctx.lo, ctx.hi)
        if self.row_parallel:
            buf = parallel_state.all_reduce_sum(buf)
        if y.dtype == torch.float32 and y.is_contiguous():
            expand_dispatch(buf, self.b, ctx.indices, y.view(-1, y.shape[-1]), self.slice_sizes, ctx.lo, ctx.hi)
            return y
        delta = torch.zeros(y.numel() // y.shape[-1], y.shape[-1], dtype=torch.float32, device=y.device)
        expand_dispatch(buf, self.b, ctx.indices, delta, self.slice_sizes, ctx.lo, ctx.hi)
        return y.add_(delta.view_as(y).to(y.dtype))


def lora_layers(model: nn.Module) -> dict[tuple[int, str], Linear]:
    """The model's target projections by (decoder layer index, our module name)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers to put LoRA adapters on")
    out: dict[tuple[int, str], Linear] = {}
    for i, layer in enumerate(layers):
        for name in LORA_TARGETS:
            try:
                module = layer.get_submodule(name)
            except AttributeError:  # e.g. a mixture-of-experts block has no mlp.gate_up_proj
                continue
            if isinstance(module, Linear):
                out[(i, name)] = module
    return out


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

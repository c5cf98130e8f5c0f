"""A batch's tokens grouped by adapter slot (a stable sort, fixed shapes): what the Triton LoRA
kernels (lora/triton_ops.py) tile over, so that each tile reads one slot's weights once.

Apart from lora/ops.py, which picks the kernels and imports triton_ops only on CUDA.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Segments(NamedTuple):
    """The batch's tokens grouped by slot, for kernels that read a slot's weights once per tile
    of its tokens. Fixed shapes (no host sync): segment j holds slot `slots[j]` (-1, 0, ...,
    S - 1), possibly no token."""

    order: torch.Tensor  # [T] int64: token ids sorted by slot, stable (batch order within a slot)
    starts: torch.Tensor  # [S + 2] int64: segment j is order[starts[j]:starts[j + 1]]
    slots: torch.Tensor  # [S + 1] int64: -1 (base-model tokens), 0, ..., S - 1


def segments(indices: torch.Tensor, num_slots: int) -> Segments:
    """Group the tokens of `indices` (int, -1..num_slots-1) by slot."""
    idx = indices.long()
    counts = torch.bincount(idx + 1, minlength=num_slots + 1)
    starts = torch.zeros(num_slots + 2, dtype=torch.int64, device=indices.device)
    torch.cumsum(counts, 0, out=starts[1:])
    order = torch.argsort(idx, stable=True)
    return Segments(order, starts, torch.arange(-1, num_slots, device=indices.device))

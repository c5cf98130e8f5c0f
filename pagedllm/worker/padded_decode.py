"""A decode step padded to a fixed batch size, in persistent buffers: what both graph runners share.

Static shapes are what torch.compile'd graphs (worker/decode_graphs.py, CPU) and captured CUDA
graphs (worker/cuda_graphs.py, GPU) need; a captured graph also reads its inputs at fixed
addresses, so every step is copied into the same buffers. A decode-only step of `n` sequences runs
in the smallest bucket `>= n`, its rows `n..bucket` padded:

- padded rows write their K/V into a *scratch block* (one block past the pool, which the block
  pool never hands out) and attend over that one slot (context length 1); their logits are dropped;
- block tables are always `[bucket, table_width]` (`table_width` covers `max_model_len`); the
  attention reads only each row's first `ceil(context_len / block_size)` entries, so stale ids
  past them (from earlier, longer rows) are never read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagedllm.layers.attention import AttentionMetadata


def bucket_for(batch_sizes: Sequence[int], num_seqs: int) -> int | None:
    """The smallest of the (sorted) `batch_sizes` that holds `num_seqs` rows; None above them all."""
    for b in batch_sizes:
        if b >= num_seqs:
            return b
    return None


class DecodeStep(nn.Module):
    """One decode step (model + LM head) as a pure function of tensors: what is compiled or captured."""

    def __init__(self, model: nn.Module, block_size: int) -> None:
        super().__init__()
        self.model = model
        self.block_size = block_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        md = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_size=self.block_size,
            num_decode_tokens=input_ids.shape[0],
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
        )
        hidden = self.model(input_ids, positions, kv_caches, md)
        return self.model.compute_logits(hidden)


class StaticDecodeInputs:
    """Persistent input buffers for up to `max_batch` decode rows (module docstring)."""

    def __init__(self, max_batch: int, table_width: int, block_size: int, scratch_block: int,
                 device: torch.device) -> None:
        self.max_batch = max_batch
        self.table_width = table_width
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(max_batch, **long)
        self.slot_mapping = torch.full((max_batch,), self.scratch_slot, **long)
        self.block_tables = torch.full((max_batch, table_width), scratch_block, **long)
        self.context_lens = torch.ones(max_batch, **long)

    def views(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """The first `bucket` rows of every buffer: (ids, positions, slots, tables, context lengths)."""
        return (self.input_ids[:bucket], self.positions[:bucket], self.slot_mapping[:bucket],
                self.block_tables[:bucket], self.context_lens[:bucket])

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
             block_tables: torch.Tensor, context_lens: torch.Tensor, bucket: int) -> tuple[torch.Tensor, ...]:
        """Copy a step of `n <= bucket` rows in (device to device), pad rows `n..bucket`; the views."""
        n = input_ids.shape[0]
        width = block_tables.shape[1]
        if n > bucket or bucket > self.max_batch or width > self.table_width:
            raise ValueError(f"a decode step of {n} rows and {width} table columns does not fit bucket "
                             f"{bucket} of at most {self.max_batch} rows and {self.table_width} columns")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.block_tables[:n, :width].copy_(block_tables)
        self.context_lens[:n].copy_(context_lens)
        if n < bucket:
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(self.scratch_slot)
            self.block_tables[n:bucket, 0].fill_(self.scratch_block)
            self.context_lens[n:bucket].fill_(1)
        return self.views(bucket)

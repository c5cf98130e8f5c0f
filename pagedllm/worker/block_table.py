"""Persistent per-sequence block tables in the runner, as vLLM v1's `BlockTable`.

One int64 row per live sequence in a preallocated array (numpy, so that writing a few ids costs
nanoseconds; `tensor` is a torch view of the same memory). The scheduler sends deltas only
(`ScheduledSequence.blocks_from` / `new_block_ids`, from `KVCacheManager.take_table_delta`):
`apply` writes those ids at their place, usually none or one; a table new to the runner comes
whole (from 0). Rows live until the scheduler says the table is gone (`release`, from
`SchedulerOutput.released_seq_ids`); the array grows when every row is taken. The step's
tensors are gathered with one indexing op (`rows`), never built row by row from lists.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    def __init__(self, max_blocks_per_seq: int, num_rows: int = 64) -> None:
        if max_blocks_per_seq < 1 or num_rows < 1:
            raise ValueError(f"max_blocks_per_seq ({max_blocks_per_seq}) and num_rows ({num_rows}) must be positive")
        self._ids = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int64)
        self.tensor = torch.from_numpy(self._ids)
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._len = [0] * num_rows  # ids held by each row
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return self._ids.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self._ids.shape[1]

    @property
    def num_live(self) -> int:
        return len(self._row_of)

    def apply(self, seq_id: int, start: int, ids: list[int]) -> int:
        """Make `seq_id`'s row its first `start` ids followed by `ids`; returns the row."""
        row = self._row_of.get(seq_id)
        if row is None:
            if start != 0:
                raise ValueError(f"sequence {seq_id}: a block table delta from {start} for a table "
                                 "the runner does not hold (the scheduler and the runner disagree)")
            row = self._take_row(seq_id)
        elif start > self._len[row]:
            raise ValueError(f"sequence {seq_id}: a block table delta from {start}, but the runner "
                             f"holds {self._len[row]} ids")
        end = start + len(ids)
        if end > self._ids.shape[1]:
            self._resize(self._ids.shape[0], max(end, 2 * self._ids.shape[1]))
        if ids:
            self._ids[row, start:end] = ids
        old = self._len[row]
        if end < old:
            self._ids[row, end:old] = 0  # padding stays 0, as AttentionMetadata says
        self._len[row] = end
        return row

    def num_blocks(self, row: int) -> int:
        return self._len[row]

    def num_blocks_of(self, seq_id: int) -> int:
        """How many ids `seq_id`'s table holds (0: none): a delta from there changes nothing."""
        row = self._row_of.get(seq_id)
        return 0 if row is None else self._len[row]

    def ids(self, seq_id: int) -> list[int]:
        """The table held for `seq_id` (tests compare it with the scheduler's view)."""
        row = self._row_of.get(seq_id)
        return [] if row is None else self._ids[row, : self._len[row]].tolist()

    def release(self, seq_id: int) -> None:
        row = self._row_of.pop(seq_id, None)
        if row is not None:
            self._ids[row, : self._len[row]] = 0
            self._len[row] = 0
            self._free.append(row)

    def _take_row(self, seq_id: int) -> int:
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._row_of[seq_id] = row
        self._len[row] = 0
        return row

    def _grow(self) -> None:
        old = self._ids.shape[0]
        self._resize(2 * old, self._ids.shape[1])
        self._len += [0] * old
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _resize(self, rows: int, width: int) -> None:
        # A new array: tensors handed out for earlier steps keep the old memory.
        ids = np.zeros((rows, width), dtype=np.int64)
        r, w = self._ids.shape
        ids[:r, :w] = self._ids
        self._ids = ids
        self.tensor = torch.from_numpy(ids)

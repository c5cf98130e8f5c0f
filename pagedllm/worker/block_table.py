"""Persistent per-sequence block tables in the runner, as vLLM v1's `BlockTable`.

One int64 row per sequence in a preallocated array (numpy, so that writing a few ids costs
nanoseconds; `tensor` is a torch view of the same memory). Each step the runner hands
`update(seq_id, block_ids)` the scheduler's table for every scheduled sequence; only ids past
what the row already holds are written. A table that changed inside the part already written
(copy-on-write of the last block, swap in, recompute after preemption) is detected by comparing
with the row's copy (a C-speed list comparison) and the row is rewritten from there.

Rows of sequences that were not scheduled in the current step are reused when the array is
full; a reused sequence simply gets its table written again when it comes back. The step's
tensors are then gathered with one indexing op (`rows`), not built row by row from lists.
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
        self._seq_of: list[int | None] = [None] * num_rows
        self._written: list[list[int]] = [[] for _ in range(num_rows)]  # ids held by each row
        self._last_step = [-1] * num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        self._step = 0

    @property
    def num_rows(self) -> int:
        return self._ids.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self._ids.shape[1]

    def begin_step(self) -> None:
        """Rows used from now on belong to this step and are not reused within it."""
        self._step += 1

    def update(self, seq_id: int, block_ids: list[int]) -> int:
        """Make `seq_id`'s row hold `block_ids`; returns the row."""
        n = len(block_ids)
        if n > self._ids.shape[1]:
            self._widen(n)
        row = self._row_of.get(seq_id)
        if row is None:
            row = self._take_row(seq_id)
        self._last_step[row] = self._step
        written = self._written[row]
        k = len(written)
        if n >= k and block_ids[:k] == written:  # the usual case: nothing or a new block
            if n > k:
                self._ids[row, k:n] = block_ids[k:]
                written.extend(block_ids[k:])
        else:
            self._ids[row, :n] = block_ids
            if n < k:
                self._ids[row, n:k] = 0  # padding stays 0, as AttentionMetadata says
            self._written[row] = list(block_ids)
        return row

    def release(self, seq_id: int) -> None:
        row = self._row_of.pop(seq_id, None)
        if row is not None:
            self._seq_of[row] = None
            self._written[row] = []
            self._free.append(row)

    def _take_row(self, seq_id: int) -> int:
        if not self._free:
            idle = [r for r, step in enumerate(self._last_step) if step != self._step]
            if idle:
                for r in idle:
                    old = self._seq_of[r]
                    if old is not None:
                        self.release(old)
            else:
                self._grow()
        row = self._free.pop()
        self._row_of[seq_id] = row
        self._seq_of[row] = seq_id
        self._written[row] = []
        return row

    def _grow(self) -> None:
        old = self._ids.shape[0]
        self._resize(2 * old, self._ids.shape[1])
        self._seq_of += [None] * old
        self._written += [[] for _ in range(old)]
        self._last_step += [-1] * old
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _widen(self, n: int) -> None:
        self._resize(self._ids.shape[0], max(n, 2 * self._ids.shape[1]))

    def _resize(self, rows: int, width: int) -> None:
        # A new array: tensors handed out for earlier steps keep the old memory.
        ids = np.zeros((rows, width), dtype=np.int64)
        r, w = self._ids.shape
        ids[:r, :w] = self._ids
        self._ids = ids
        self.tensor = torch.from_numpy(ids)

"""The step message that rank 0 sends to the other tensor-parallel ranks.

The scheduler runs once, in the engine core; a worker never sees a request or a `Sequence`, only
what its model runner reads (worker/model_runner.py's contract): per scheduled sequence its id,
the tokens run this step, their first position, its block table and whether it samples /
wants every row's logits; and the step's swap-out, swap-in and copy-on-write block pairs.

Block tables travel as diffs (`BlockTableMirror`): both ends keep the table last sent for each
sequence; a step sends only the ids appended since (usually none, or one new block), and the
whole table only when it changed inside (copy-on-write of the last block, swap-in, recompute)
or was forgotten. Both ends forget the same entries at the same steps (`prune`), so the
mirrors stay equal without a reply. The message is one pickled tuple of ints and lists
(`encode_step`), pickled once and written to every worker.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# scheduled entry: (seq_id, token_ids, start_pos, kept, new_ids, flags, seq_len)
_SAMPLE, _ALL_LOGITS = 1, 2


class BlockTableMirror:
    """The block table each end believes the other holds, per sequence id."""

    def __init__(self, keep: int = 256) -> None:
        self.tables: dict[int, list[int]] = {}
        self.keep = keep  # forget sequences absent from a step once more than this are held

    def encode(self, seq_id: int, table: list[int]) -> tuple[int, list[int]]:
        """(number of ids the receiver keeps, ids to append); kept 0 replaces its table."""
        old = self.tables.get(seq_id)
        if old is not None:
            n = len(old)
            if len(table) >= n and table[:n] == old:  # the usual case: nothing or a new block
                tail = table[n:]
                old.extend(tail)
                return n, tail
        self.tables[seq_id] = list(table)
        return 0, list(table)

    def decode(self, seq_id: int, kept: int, ids: list[int]) -> list[int]:
        if kept == 0:
            table = self.tables[seq_id] = list(ids)
            return table
        table = self.tables[seq_id]
        if len(table) != kept:
            raise RuntimeError(f"block table mirror of sequence {seq_id} holds {len(table)} ids, the sender "
                               f"kept {kept}: the ranks disagree")
        table.extend(ids)
        return table

    def prune(self, step_seq_ids: set[int]) -> None:
        """Run by both ends after every step, with the same ids: they forget the same entries."""
        if len(self.tables) > max(self.keep, 2 * len(step_seq_ids)):
            for seq_id in [s for s in self.tables if s not in step_seq_ids]:
                del self.tables[seq_id]


class SeqRef(NamedTuple):
    seq_id: int


class StepSequence(NamedTuple):
    """What a worker's runner reads of one scheduled sequence (duck-types ScheduledSequence)."""

    seq: SeqRef
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    all_logits: bool
    seq_len: int = 0


@dataclass
class StepInput:
    """A worker's scheduler output (duck-types SchedulerOutput for ModelRunner.execute_model)."""

    scheduled: list[StepSequence]
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)


def encode_step(scheduler_output: Any, mirror: BlockTableMirror) -> bytes:
    """The pickled step message for `scheduler_output` (updates `mirror`)."""
    entries = []
    ids = set()
    for s in scheduler_output.scheduled:
        seq_id = s.seq.seq_id
        ids.add(seq_id)
        kept, new = mirror.encode(seq_id, s.block_table)
        flags = (_SAMPLE if s.sample else 0) | (_ALL_LOGITS if s.all_logits else 0)
        entries.append((seq_id, s.token_ids, s.start_pos, kept, new, flags, getattr(s, "seq_len", 0)))
    mirror.prune(ids)
    msg = ("step", entries, list(getattr(scheduler_output, "block_copies", None) or ()),
           list(getattr(scheduler_output, "blocks_to_swap_out", None) or ()),
           list(getattr(scheduler_output, "blocks_to_swap_in", None) or ()))
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode_step(msg: tuple, mirror: BlockTableMirror) -> StepInput:
    """A worker's StepInput from a decoded ("step", ...) message (updates `mirror`)."""
    _, entries, copies, swap_out, swap_in = msg
    scheduled = []
    for seq_id, token_ids, start_pos, kept, new, flags, seq_len in entries:
        table = mirror.decode(seq_id, kept, new)
        scheduled.append(StepSequence(SeqRef(seq_id), token_ids, start_pos, table,
                                      bool(flags & _SAMPLE), bool(flags & _ALL_LOGITS), seq_len))
    mirror.prune({e[0] for e in entries})
    return StepInput(scheduled, copies, swap_out, swap_in)

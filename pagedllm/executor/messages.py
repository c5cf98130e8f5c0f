"""The step message that rank 0 sends to the other tensor-parallel ranks.

The scheduler runs once, in the engine core; a worker never sees a request or a `Sequence`, only
what its model runner reads (worker/model_runner.py's contract): per scheduled sequence its id,
the tokens run this step, their first position, the change to its block table, whether it
samples / wants every row's logits and its draft tokens (speculative decoding: the runner
projects a logits row for each, and every rank must project the same rows, or the vocab-parallel
gather of the logits mixes rows) and its LoRA adapter id; the tables released since the previous
step; the step's swap-out, swap-in and copy-on-write block pairs; and the step's LoRA requests
(each rank loads an adapter it does not hold from its path, cut to its shard).

Block tables travel as the scheduler's own deltas (`blocks_from`, `new_block_ids`: usually
nothing or one new block), forwarded as they are: every rank's runner keeps the same tables by
applying the same deltas, so nothing is compared or mirrored here. The message is one pickled
tuple of ints and lists (`encode_step`), pickled once and written to every worker.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# scheduled entry: (seq_id, token_ids, start_pos, blocks_from, new_block_ids, flags, seq_len,
# group_deltas, draft_token_ids); the adapters of the sequences that have one, by seq id
_SAMPLE, _ALL_LOGITS = 1, 2


class SeqRef(NamedTuple):
    seq_id: int


class StepSequence(NamedTuple):
    """What a worker's runner reads of one scheduled sequence (duck-types ScheduledSequence)."""

    seq: SeqRef
    token_ids: list[int]
    start_pos: int
    blocks_from: int
    new_block_ids: list[int]
    sample: bool
    all_logits: bool
    seq_len: int = 0
    group_deltas: tuple = ()  # a hybrid KV cache's other groups: ((blocks_from, ids), ...)
    draft_token_ids: tuple = ()  # the last len() of token_ids are drafts (speculative decoding)
    lora_int_id: int = 0  # its LoRA adapter (0: the base model)


@dataclass
class StepInput:
    """A worker's scheduler output (duck-types SchedulerOutput for ModelRunner.execute_model)."""

    scheduled: list[StepSequence]
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    released_seq_ids: list[int] = field(default_factory=list)
    lora_requests: dict[int, Any] = field(default_factory=dict)


def encode_step(scheduler_output: Any) -> bytes:
    """The pickled step message for `scheduler_output`."""
    entries = []
    for s in scheduler_output.scheduled:
        flags = (_SAMPLE if s.sample else 0) | (_ALL_LOGITS if s.all_logits else 0)
        entries.append((s.seq.seq_id, s.token_ids, s.start_pos, s.blocks_from, s.new_block_ids,
                        flags, getattr(s, "seq_len", 0), tuple(getattr(s, "group_deltas", ())),
                        tuple(getattr(s, "draft_token_ids", ()))))
    msg = ("step", entries, list(getattr(scheduler_output, "block_copies", None) or ()),
           list(getattr(scheduler_output, "blocks_to_swap_out", None) or ()),
           list(getattr(scheduler_output, "blocks_to_swap_in", None) or ()),
           list(getattr(scheduler_output, "released_seq_ids", None) or ()),
           dict(getattr(scheduler_output, "lora_requests", None) or {}),
           # only the sequences with an adapter: a step without LoRA pays nothing for it
           {s.seq.seq_id: s.lora_int_id for s in scheduler_output.scheduled if getattr(s, "lora_int_id", 0)})
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode_step(msg: tuple) -> StepInput:
    """A worker's StepInput from a decoded ("step", ...) message."""
    _, entries, copies, swap_out, swap_in, released, loras, lora_ids = msg
    scheduled = [StepSequence(SeqRef(seq_id), token_ids, start_pos, blocks_from, new_ids,
                              bool(flags & _SAMPLE), bool(flags & _ALL_LOGITS), seq_len, deltas, drafts,
                              lora_ids.get(seq_id, 0))
                 for seq_id, token_ids, start_pos, blocks_from, new_ids, flags, seq_len, deltas, drafts
                 in entries]
    return StepInput(scheduled, copies, swap_out, swap_in, released, loras)

"""The scheduler's decision for one step: what each sequence runs and which cache ops go first.

Its own module because it is the contract between the scheduler and everything after it (the
step planner, speculation, the watchdog), which read it without needing the scheduling loop.
"""

from __future__ import annotations

import msgspec

from pagedllm.core.request import SequenceState
from pagedllm.multimodal.inputs import MultiModalFeature


class ScheduledSequence(msgspec.Struct, frozen=True):
    """The scheduler's decision for one sequence this step; the engine core turns it into the
    runner's `SequenceStep` (core/step_plan.py), adding what only it knows. A frozen msgspec
    Struct, not a frozen dataclass: 0.14 us to build against 1.3 (a frozen dataclass's
    `__init__` sets every field through `object.__setattr__`: 0.3 ms a step at 256 rows)."""

    seq: SequenceState
    token_ids: list[int]  # tokens fed this step, at positions start_pos .. start_pos+len-1
    start_pos: int  # seq.num_computed_tokens before this step
    # The runner's copy of the seq's block table becomes its first `blocks_from` ids followed
    # by `new_block_ids` (KVCacheManager.take_table_delta): usually nothing or one new block;
    # the whole table (from 0) when it is new to the runner. It then covers start_pos+len tokens.
    blocks_from: int
    new_block_ids: list[int]
    sample: bool  # the step reaches the last known token: sample one from the last row
    # The sequence's length (prompt + output so far) when scheduled: a length-dependent
    # positional encoding (Phi-3 LongRoPE) picks its regime from it. 0: start_pos + len(token_ids).
    seq_len: int = 0
    # Hybrid KV cache: (blocks_from, new_block_ids) of groups 1.. (group 0 is above); empty
    # with one group.
    group_deltas: tuple[tuple[int, list[int]], ...] = ()
    # Speculative decoding: the draft tokens at the end of `token_ids` (after the sequence's
    # last known token), each position's logits verify the next; empty: no proposal.
    draft_token_ids: list[int] = []
    # Multi-LoRA: the adapter it runs with (0: the base model).
    lora_int_id: int = 0
    # Image inputs: (content hash, position, length, first row) of the image rows this chunk
    # takes in place of its placeholder tokens (multimodal/inputs.py `runs_in`).
    mm_runs: list[tuple[bytes, int, int, int]] = []


class SchedulerOutput(msgspec.Struct, frozen=True):
    scheduled: list[ScheduledSequence]
    block_copies: list[tuple[int, int]]  # (src, dst) CoW copies to do BEFORE the forward
    preempted: list[int]  # seq ids preempted this step (recomputed or swapped out)
    num_batched_tokens: int
    # Done before the forward in this order: swap out, swap in, then the block copies.
    blocks_to_swap_out: list[tuple[int, int]] = []  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = []  # (host, device)
    # Sequences whose tables are gone (finished, preempted, swapped out) since the previous
    # step: the runner drops its copies of them, before it applies this step's deltas.
    released_seq_ids: list[int] = []
    # Sequences that left for good (finished, aborted) since the previous step: the runner
    # drops their sampling rows (a preempted sequence keeps its row: it comes back).
    finished_seq_ids: list[int] = []
    # Image inputs (core/encoder_cache.py): the images the runner encodes this step, after
    # dropping the rows of `freed_encoder_hashes`.
    encoder_inputs: list[MultiModalFeature] = []
    freed_encoder_hashes: list[bytes] = []

    @property
    def has_cache_ops(self) -> bool:
        return bool(self.block_copies or self.blocks_to_swap_out or self.blocks_to_swap_in)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

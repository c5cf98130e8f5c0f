"""The step plan: everything a model runner needs for one step, typed and frozen.

The engine core assembles it completely (engine/step_planner.py) from the scheduler's decision
(`SchedulerOutput`) and its own parts — the prompt-logprob rows, a draft model's inputs, the
grammar masks, the LoRA adapters, the sampling rows of new sequences — before any runner sees
it, and nothing changes it afterwards. One type serves in process and across tensor-parallel
ranks: rank 0 sends every other rank the same plan without its rank-0-only parts (the sampling
rows and the masks: only rank 0 samples), encoded with msgpack (`encode_for_workers`).

A runner never sees a request or a `Sequence`, only ids, tokens, positions and block-table
deltas. Block tables travel as the scheduler's deltas (`blocks_from`, `new_block_ids`: usually
nothing or one new block): every rank's runner keeps the same tables by applying the same deltas.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature


class SequenceStep(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """One scheduled sequence's part of the step."""

    seq_id: int
    token_ids: list[int]  # run at positions start_pos .. start_pos + len - 1
    start_pos: int
    # The runner's copy of the block table becomes its first `blocks_from` ids followed by
    # `new_block_ids`; the whole table (from 0) when the sequence is new to the runner.
    blocks_from: int
    new_block_ids: list[int]
    sample: bool  # the step reaches the last known token: a token is drawn from the last row
    all_logits: bool = False  # every row's logits back (prompt logprobs)
    # The sequence's length when scheduled (Phi-3 LongRoPE picks its regime from it); 0:
    # start_pos + len(token_ids).
    seq_len: int = 0
    # Hybrid KV cache: (blocks_from, new_block_ids) of groups 1.. (group 0 is above).
    group_deltas: tuple[tuple[int, list[int]], ...] = ()
    # Speculative decoding: the draft tokens at the end of `token_ids`; each position's logits
    # verify the next.
    draft_token_ids: list[int] = []
    # A draft model: the tokens it runs this step at positions `draft_start ..`, before the target.
    draft_start: int = 0
    draft_input_ids: list[int] = []
    lora_int_id: int = 0  # its LoRA adapter (0: the base model)
    # Pooling models (docs/pooling.md): the runner returns this step's final hidden rows of the
    # sequence (an encoder classifier: its logits row) instead of logits to sample from; a
    # pooling core's steps pool every sequence.
    pool: bool = False
    token_type_ids: list[int] = []  # an encoder's segment ids (a cross-encoder's pair); [] : all 0
    # Image inputs: (content hash, position, length, first row) of the image rows that replace
    # the embedding of placeholder tokens in this chunk (worker/mm_embeddings.py).
    mm_runs: list[tuple[bytes, int, int, int]] = []
    # M-RoPE models (Qwen2-VL; multimodal/mrope.py): the rotary positions [3][k] of the chunk's
    # first k tokens where it overlaps an image; every other token's is its position + delta.
    mrope_positions: list[list[int]] = []
    mrope_delta: int = 0


class StepPlan(msgspec.Struct, frozen=True, gc=False):
    """One step. Cache operations run first, in this order: swap out, swap in, block copies."""

    sequences: list[SequenceStep]
    num_batched_tokens: int = 0
    block_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write copies
    blocks_to_swap_out: list[tuple[int, int]] = []  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = []  # (host, device)
    # Tables gone since the previous step (finished, preempted, swapped out): dropped first.
    released_seq_ids: list[int] = []
    # Sequences that left for good: their sampling rows go (a preempted one keeps its row).
    finished_seq_ids: list[int] = []
    # The adapters of this step's sequences, by id: a runner loads any it does not hold.
    lora_requests: dict[int, LoRARequest] = {}
    # Image inputs (core/encoder_cache.py): every rank drops the rows of `freed_encoder_hashes`,
    # then encodes `encoder_inputs` into its encoder cache, before the forward.
    encoder_inputs: list[MultiModalFeature] = []
    freed_encoder_hashes: list[bytes] = []
    # Rank 0 only. The sampling rows of sequences new since the previous step
    # (worker/input_batch.SamplingRowSpec), and the grammar masks: a future the core fills while
    # the forward runs (seq id, or (seq id, j) after j drafts -> packed allowed-token row).
    new_sampling_rows: list[Any] = []
    token_masks: Any = None

    @property
    def has_cache_ops(self) -> bool:
        return bool(self.block_copies or self.blocks_to_swap_out or self.blocks_to_swap_in)

    @property
    def has_work(self) -> bool:
        """Whether a runner has anything to do: sequences, cache operations, tables or rows to drop."""
        return bool(self.sequences or self.has_cache_ops or self.released_seq_ids
                    or self.finished_seq_ids or self.new_sampling_rows or self.encoder_inputs
                    or self.freed_encoder_hashes)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepPlan)


def encode_for_workers(plan: StepPlan) -> bytes:
    """The plan as tensor-parallel ranks > 0 get it: without the sampling rows and masks."""
    return _ENCODER.encode(msgspec.structs.replace(plan, new_sampling_rows=[], token_masks=None))


def decode_from_rank0(payload: bytes) -> StepPlan:
    return _DECODER.decode(payload)

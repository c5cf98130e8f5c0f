"""Per-sequence state shared by the scheduler, the KV cache manager and the engine.

A *request* (one prompt, one SamplingParams) owns one or more *sequences*: n > 1 forks the
prompt's sequence after prefill. The scheduler and the KV cache manager work on sequences; the
engine groups them back into a RequestOutput. This module imports no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue (new, or preempted for recompute)
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its blocks wait in host memory
    FINISHED_STOPPED = "stop"  # EOS, stop token id or stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish_reason string, or None while unfinished."""
        return self.value if self.is_finished else None


@dataclass(eq=False)
class SequenceState:
    """One token stream: prompt + generated tokens, and how much of it is in the KV cache.

    `num_computed_tokens` counts tokens whose K/V are written in the cache (or were found in the
    prefix cache). A sequence needs `num_tokens - num_computed_tokens` more tokens run through
    the model; when that reaches the last token, the step samples a new one.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    arrival_time: float
    index: int = 0  # which of the request's n samples
    cache_salt: str | None = None
    # The request's priority (lower = earlier); used only by the "priority" scheduling policy.
    priority: int = 0
    # Prompt logprobs need every prompt position computed, so such a sequence skips prefix hits.
    skip_prefix_cache: bool = False
    # Its K/V are computed in the model's long-context regime (Phi-3 LongRoPE's long factors:
    # `SchedulerConfig.long_context_after`). Keys the prefix-cache hash: blocks computed in the
    # two regimes hold different K/V for the same tokens and must never match.
    long_context: bool = False
    # Multi-LoRA (docs/lora.md): the adapter this sequence runs with (0: the base model), and
    # the adapter's identity that keys the prefix-cache hash (blocks computed under one adapter
    # hold other K/V than the same tokens under another or under the base, and must never match).
    lora_int_id: int = 0
    lora_key: str | None = None
    # Its prompt's images (multimodal/inputs.py), shared by every sequence of the request: the
    # encoder cache and the prefix-cache hashes of the blocks their runs touch read them.
    mm_features: tuple[Any, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    # Prompt tokens found in the prefix cache at first admission (None until admitted).
    num_cached_tokens: int | None = None
    # Structured outputs: this sample's grammar matcher (xgrammar's, each sample its own),
    # advanced by every accepted token, dropped when it finishes. Engine-side; opaque to core/.
    grammar: Any = None
    # Speculative decoding: the draft tokens proposed for its next decode step (engine-set;
    # the scheduler runs them after its last token when the budget allows).
    spec_token_ids: list[int] = field(default_factory=list)
    # A draft model's KV is written for positions [0, draft_num_computed) (engine-set; never
    # more than num_computed_tokens: a rollback or recompute clamps it; spec_decode/draft_model.py).
    draft_num_computed: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

"""What a scheduler may do (`SchedulerConfig`) and which requests it can ever accept.

Apart from the scheduler so that a front end in another process (the async engine, the pooling
inputs, the OpenAI request fields) can check a request by the same rules without importing the
scheduling loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.kv_cache_groups import KVCacheGroups


def check_request_fits_pool(
    num_tokens: int, num_lockstep_seqs: int, num_blocks: int, block_size: int,
    groups: KVCacheGroups | None = None, chunk: int = 0,
) -> None:
    """`Scheduler.check_request_fits` on the pool's numbers alone, so that a front end in
    another process rejects by the same rule before the request ever reaches the core.
    `groups` (a KV cache with sliding groups): one sequence's peak over its groups in steps of
    at most `chunk` tokens, against the pool less its null block."""
    blocks = -(-num_tokens // block_size)
    where = ""
    if groups is not None and groups.has_null_block:
        blocks = groups.peak_blocks(num_tokens, block_size, chunk)
        num_blocks -= 1
        where = f" at its peak over {len(groups.groups)} KV cache group(s)"
    if num_lockstep_seqs > 1 and blocks * num_lockstep_seqs > num_blocks:
        raise ValueError(
            f"Beam search with width {num_lockstep_seqs} needs up to "
            f"{blocks * num_lockstep_seqs} KV cache blocks but the pool has "
            f"{num_blocks}; lower the width or max_tokens."
        )
    if blocks > num_blocks:
        raise ValueError(
            f"The request needs {blocks} KV cache blocks ({num_tokens} tokens at block_size="
            f"{block_size}{where}) but the whole pool has {num_blocks} blocks "
            f"({num_blocks * block_size} tokens); raise kv_cache_space or lower "
            "max_tokens."
        )


SCHEDULING_POLICIES = ("fcfs", "priority")


def check_priority(priority: int, policy: str) -> None:
    """vLLM's rule: a request's priority must be an int, and non-zero only under "priority"
    (under fcfs it would be silently meaningless)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}.")
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority={priority} needs the priority scheduling policy; this engine runs "
            f"'{policy}' (start it with --scheduling-policy priority)."
        )


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # None: swap a preempted group with several running sequences, recompute a single one.
    preemption_mode: str | None = None  # "recompute" | "swap" force one
    # "fcfs" (priorities ignored) or "priority" (lower Sequence.priority runs first).
    policy: str = "fcfs"
    # Models whose positional encoding depends on the sequence's length (Phi-3 LongRoPE: short
    # factors up to `original_max_position_embeddings` tokens, long ones beyond, for every
    # position): a sequence longer than this many tokens runs in the long-context regime
    # (`Sequence.long_context`), and one that grows past it is recomputed once from its first
    # token, as transformers' Phi-3 drops its cache at that point. None: no such regime.
    long_context_after: int | None = None
    # Multi-LoRA: at most this many distinct adapters among the running sequences (the runner's
    # adapter slots, `max_loras`); 0: LoRA off. A waiting request whose adapter would be one
    # more waits (later ones with a running adapter, or the base model, may go ahead), as vLLM.
    max_loras: int = 0
    # Image inputs (core/encoder_cache.py): the embedding rows the encoder may compute in one
    # step, and the rows the runner's encoder cache holds. 0: max(max_num_batched_tokens, 16384),
    # so that one large image (Qwen2-VL's largest is 16384 rows) always fits.
    max_num_encoder_input_tokens: int = 0
    encoder_cache_size: int = 0

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"policy must be one of {list(SCHEDULING_POLICIES)}, got {self.policy!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0 (0: the default), got {getattr(self, name)}")
            if getattr(self, name) == 0:
                setattr(self, name, max(self.max_num_batched_tokens, 16384))
        if self.long_context_after is not None and self.long_context_after < 1:
            raise ValueError(f"long_context_after must be at least 1, got {self.long_context_after}")
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be None, 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Otherwise a long prompt could never be admitted and would wait forever.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}) when chunked prefill is disabled"
            )

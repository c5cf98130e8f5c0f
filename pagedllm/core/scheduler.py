"""Continuous batching: which sequences run this step, and how many tokens each.

One token budget per step (`max_num_batched_tokens`), as in vLLM v1: running sequences are
served first (a decode is 1 token, an unfinished prefill takes what is left of the budget), then
swapped-out groups come back (oldest first), then waiting ones are admitted FCFS with prefill
chunks from what remains. When a running sequence cannot get a block, the most recently arrived
running request is preempted and the allocation retried, as vLLM v0 did: a request with several
running sequences (n > 1, beam search) is swapped out whole to host memory, keeping its sharing;
a single sequence is recomputed (blocks freed, requeued at the front of the waiting queue,
readmitted only once the free blocks hold its whole length: `_fits_whole`);
`preemption_mode` forces either. A step that preempted admits nothing new and swaps nothing in,
so the pool can drain; nothing new is admitted while a group waits in host memory.

Lockstep groups. A beam search's sequences wait for each other: a beam whose tokens are all
computed runs nothing until every sibling has its row. Such a group is never split between
`running` and the other queues: it is swapped whole or, when the host pool cannot take it,
recomputed whole, and its waiting members are admitted together or not at all. (n > 1 samples
are independent, so one of them alone may be recomputed.) Splitting a beam group could stall
for good: beams waiting for a sibling that is never admitted, because the idle beams hold the
blocks that a swapped group needs before anything is admitted (tests/unit/
test_scheduler_liveness.py reproduces it).

Scheduling policy (vLLM's `--scheduling-policy`). "fcfs": every request has priority 0 and the
order is arrival, then submission. "priority": a request's `priority` (lower = earlier) comes
first: `running`, `swapped` and the whole waiting queue (preempted or not) are kept sorted by
(priority, arrival, submission), so the admission order is by priority and the preemption
victim (the tail of `running`) is the lowest-priority (largest value), latest request.

Liveness (why every accepted request finishes). Order unfinished requests by (priority,
arrival, then submission order); let R be the first (the oldest under fcfs). `check_request_fits` accepted R only
if it fits alone in the whole pool, its lockstep sequences side by side unshared.
- Device blocks are held only by running sequences (cached free blocks are evictable), and no
  running sequence is idle except a beam waiting for a running sibling that has tokens to run.
  So while anything runs, every step either computes tokens or preempts (moves blocks).
- R running: its sequences come first in `running`, so they get budget first; a shortfall
  preempts newer requests (the tail), never R while anything newer runs; alone, R fits.
- R swapped: it heads `swapped`; admission stops while a group is swapped, so `running` only
  shrinks (requests finish in bounded steps: max_tokens) until R fits; a group that could not
  fit even in an empty pool is recomputed instead.
- R waiting: it heads the waiting queue (fcfs: preempted requests go first, by priority;
  priority: the whole queue is sorted by the order above; admission stops at the first that
  does not fit), so only older-admitted or swapped groups
  run before it, each finishing or being preempted in bounded steps; then R is admitted.
R therefore finishes; then the next first is R, and so on. (Under "priority" a request that
arrives ahead of R in the order becomes the new R; with finitely many arrivals, everything
still finishes, but an endless stream of more urgent requests can starve a lower-priority
one, as in vLLM.) The engine's watchdog
(`LLMEngine.step`) turns any breach of this argument into a `SchedulerStallError` instead of a
silent spin.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_groups import KVCacheGroups
from pagedllm.core.request import SequenceState, SequenceStatus


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

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"policy must be one of {list(SCHEDULING_POLICIES)}, got {self.policy!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
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


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """The scheduler's decision for one sequence this step; the engine core turns it into the
    runner's `SequenceStep` (core/step_plan.py), adding what only it knows."""

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
    draft_token_ids: list[int] = field(default_factory=list)
    # Multi-LoRA: the adapter it runs with (0: the base model).
    lora_int_id: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    block_copies: list[tuple[int, int]]  # (src, dst) CoW copies to do BEFORE the forward
    preempted: list[int]  # seq ids preempted this step (recomputed or swapped out)
    num_batched_tokens: int
    # Done before the forward in this order: swap out, swap in, then the block copies.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    # Sequences whose tables are gone (finished, preempted, swapped out) since the previous
    # step: the runner drops its copies of them, before it applies this step's deltas.
    released_seq_ids: list[int] = field(default_factory=list)
    # Sequences that left for good (finished, aborted) since the previous step: the runner
    # drops their sampling rows (a preempted sequence keeps its row: it comes back).
    finished_seq_ids: list[int] = field(default_factory=list)

    @property
    def has_cache_ops(self) -> bool:
        return bool(self.block_copies or self.blocks_to_swap_out or self.blocks_to_swap_in)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[SequenceState] = deque()
        # Ordered by (priority, arrival_time, request order, index): the tail is the victim.
        self.running: list[SequenceState] = []
        # Groups preempted by swap, each a request's sequences, oldest request first.
        self.swapped: list[list[SequenceState]] = []
        self.num_preemptions = 0
        self.num_long_context_recomputes = 0  # sequences recomputed on growing past long_context_after
        # Unfinished sequences of each request, and the order requests were first seen in
        # (keeps a request's sequences together in `running` when arrival times tie).
        self._requests: dict[str, list[SequenceState]] = {}
        self._finished_ids: list[int] = []  # since the last schedule(): finished_seq_ids
        self._request_order: dict[str, int] = {}
        self._next_request_order = 0
        # Requests whose sequences advance together (beam search: a beam waits until all its
        # siblings have their row). They are preempted and admitted whole, never split.
        self._lockstep: set[str] = set()

    # ---- queues ---------------------------------------------------------------------------

    def _priority(self, seq: SequenceState) -> tuple[int, float, int, int, int]:
        """The scheduling order: smaller first, the largest is the preemption victim."""
        prio = seq.priority if self.config.policy == "priority" else 0
        return (prio, seq.arrival_time, self._request_order[seq.request_id], seq.index,
                seq.seq_id)

    def _insert_waiting(self, seq: SequenceState) -> None:
        """fcfs: behind every waiting sequence; priority: in (priority, arrival) order."""
        if self.config.policy == "priority":
            bisect.insort(self.waiting, seq, key=self._priority)
        else:
            self.waiting.append(seq)

    def _register(self, seq: SequenceState) -> None:
        if seq.request_id not in self._requests:
            self._requests[seq.request_id] = []
            self._request_order[seq.request_id] = self._next_request_order
            self._next_request_order += 1
        self._requests[seq.request_id].append(seq)

    def _insert_running(self, seq: SequenceState) -> None:
        bisect.insort(self.running, seq, key=self._priority)

    def check_request_fits(self, num_tokens: int, num_lockstep_seqs: int = 1) -> None:
        """Refuse (ValueError) a request that could never run, even alone in the whole pool.

        `num_lockstep_seqs` sequences that advance together (a beam search's width) must fit
        side by side unshared: they are preempted and admitted whole, and a recompute loses
        their sharing. This is the bound the liveness argument (module docstring) rests on.
        """
        kv = self.kv_cache_manager
        check_request_fits_pool(num_tokens, num_lockstep_seqs, kv.num_blocks, kv.block_size,
                                kv.kv_cache_groups, self.config.max_num_batched_tokens)

    def add_sequence(self, seq: SequenceState, lockstep: bool = False) -> None:
        """Queue a new sequence (status WAITING) behind all waiting ones.

        `lockstep`: the request's sequences (this one and its forks) advance together, as beam
        search does; the scheduler then never splits them between running and elsewhere.
        """
        self._register(seq)
        if lockstep:
            self._lockstep.add(seq.request_id)
        seq.status = SequenceStatus.WAITING
        self._insert_waiting(seq)

    def fork_sequence(self, parent: SequenceState, child: SequenceState) -> None:
        """Run `child` alongside its running `parent`, sharing the parent's blocks (CoW).

        The child holds the same computed tokens as the parent (its own sampled tokens, if any,
        are not computed yet) and is placed after its siblings in the running order.
        """
        if parent.status != SequenceStatus.RUNNING:
            raise ValueError(f"can only fork a running sequence, seq {parent.seq_id} is not")
        if child.request_id != parent.request_id:
            raise ValueError("a forked sequence must belong to its parent's request")
        child.num_computed_tokens = parent.num_computed_tokens
        if child.num_tokens < child.num_computed_tokens:
            raise ValueError(f"seq {child.seq_id} has fewer tokens than its parent computed")
        self.kv_cache_manager.fork(parent, child)
        self._register(child)
        child.status = SequenceStatus.RUNNING
        self._insert_running(child)

    def _preempt_by_recompute(self, seq: SequenceState) -> None:
        """Free its blocks and requeue it ahead of new arrivals.

        Its output tokens are kept: it resumes as a prefill of prompt + output so far. Preempted
        sequences sit at the front of the waiting queue, oldest first.
        """
        self.kv_cache_manager.free(seq)
        seq.spec_token_ids = []  # a proposal is for the step it was made for
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue_for_recompute(seq)

    def _requeue_for_recompute(self, seq: SequenceState) -> None:
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        if self.config.policy == "priority":
            self._insert_waiting(seq)  # the whole queue is in priority order
            return
        key = self._priority(seq)
        i = 0
        while (
            i < len(self.waiting)
            and self.waiting[i].num_preemptions > 0
            and self._priority(self.waiting[i]) < key
        ):
            i += 1
        self.waiting.insert(i, seq)

    def _preempt_by_swap(self, group: list[SequenceState]) -> None:
        """Move the group's blocks to host memory; it comes back, whole, before new arrivals.
        Slots given this step to a member's drafts (past its known tokens) go back first: the
        drafts will not run."""
        for seq in group:
            if seq.spec_token_ids:
                self.kv_cache_manager.trim(seq, seq.num_tokens)
                seq.spec_token_ids = []
        self.kv_cache_manager.swap_out(group)
        for seq in group:
            self.running.remove(seq)
            seq.status = SequenceStatus.SWAPPED
            seq.num_preemptions += 1
            self.num_preemptions += 1
        bisect.insort(self.swapped, group, key=lambda g: self._priority(g[0]))

    def _preempt_last(self) -> list[SequenceState]:
        """Preempt the last running request's sequences (the most recently arrived; under the
        priority policy the lowest-priority, then most recent); returns them.

        A request's running sequences are contiguous in `running`, so its group is a tail.
        A lockstep group (beam search) goes whole: swapped whole, or recomputed whole when it
        cannot be swapped. Other sequences are independent, so only the last one is recomputed.
        """
        victim = self.running[-1]
        group = [s for s in self.running if s.request_id == victim.request_id]
        lockstep = victim.request_id in self._lockstep
        mode = self.config.preemption_mode or ("swap" if len(group) > 1 else "recompute")
        if mode == "swap" and self.kv_cache_manager.can_swap_out(group):
            self._preempt_by_swap(group)
            return group
        gone = group if lockstep else [victim]
        for seq in reversed(gone):
            self.running.remove(seq)
            self._preempt_by_recompute(seq)
        return gone

    def _crossed_into_long_context(self, seq: SequenceState) -> bool:
        limit = self.config.long_context_after
        return limit is not None and not seq.long_context and seq.num_tokens > limit

    def _recompute_in_long_context(self, seq: SequenceState) -> list[SequenceState]:
        """`seq` (computed in the short regime) has grown past `long_context_after`: free its
        blocks and requeue it (its lockstep group with it) to be computed again, all of it, in
        the long regime. Not a preemption for memory: counted in `num_long_context_recomputes`."""
        group = [seq]
        if seq.request_id in self._lockstep:
            group = [s for s in self.running if s.request_id == seq.request_id]
        for s in reversed(group):
            self.running.remove(s)
            self.kv_cache_manager.free(s)
            self.num_long_context_recomputes += 1
            self._requeue_for_recompute(s)
        return group

    def _set_context_regime(self, seq: SequenceState) -> None:
        """Before a sequence's first block is looked up or computed: its regime from its length."""
        if seq.num_computed_tokens == 0:
            limit = self.config.long_context_after
            seq.long_context = limit is not None and seq.num_tokens > limit

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.config.max_num_batched_tokens
        steps: list[tuple[SequenceState, int]] = []  # (seq, num_new_tokens), in emission order
        preempted: list[int] = []

        # 1. Running sequences, oldest first. Victims come from the end of `running`: either
        #    after `index`, or a group that holds `seq` itself (then the loop ends).
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if self._crossed_into_long_context(seq):
                gone = self._recompute_in_long_context(seq)
                index -= sum(1 for s in gone if s is not seq and any(t is s for t, _ in steps))
                budget += sum(n for t, n in steps if t in gone)
                steps = [(t, n) for t, n in steps if t not in gone]
                continue  # `running` lost the sequence (and its group): `index` is the next one
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to run until the engine appends a token
                index += 1
                continue
            if num_new == 1 and seq.spec_token_ids:  # a decode with a proposal: as budget allows
                num_new += min(len(seq.spec_token_ids), budget - 1)
            allocated = True
            while allocated and not kv.allocate_slots(seq, num_new):
                gone = self._preempt_last()
                preempted.extend(s.seq_id for s in gone)
                if seq in gone:
                    allocated = False
                    for s in gone:  # members of its group scheduled before it: unschedule
                        budget += sum(n for t, n in steps if t is s)
                    steps = [(t, n) for t, n in steps if t not in gone]
            if not allocated:
                break  # `seq` was preempted: nobody after it can be served either
            steps.append((seq, num_new))
            budget -= num_new
            index += 1

        # 2. Swapped groups come back first, whole, when nothing was preempted this step.
        if not preempted:
            budget = self._swap_in(steps, budget)

        # 3. Waiting sequences, FCFS, only if nobody was preempted (else the pool would thrash)
        #    and no group waits in host memory.
        if not preempted and not self.swapped:
            budget = self._admit_waiting(steps, budget)

        # 4. Emit, running ones first, then the swapped-in, then the newly admitted.
        scheduled = []
        for seq, n in steps:
            blocks_from, new_block_ids = kv.take_table_delta(seq.seq_id)
            known = min(n, seq.num_tokens - seq.num_computed_tokens)
            drafts = seq.spec_token_ids[: n - known]
            scheduled.append(ScheduledSequence(
                seq=seq,
                token_ids=seq.token_ids_slice(seq.num_computed_tokens, seq.num_computed_tokens + known)
                + drafts,
                start_pos=seq.num_computed_tokens,
                blocks_from=blocks_from,
                new_block_ids=new_block_ids,
                sample=seq.num_computed_tokens + known == seq.num_tokens,
                seq_len=seq.num_tokens,
                group_deltas=tuple(kv.take_table_delta(seq.seq_id, g)
                                   for g in range(1, len(kv.groups))) if kv.is_hybrid else (),
                draft_token_ids=drafts,
                lora_int_id=seq.lora_int_id,
            ))
        swap_out, swap_in = kv.take_pending_swaps()
        return SchedulerOutput(
            scheduled=scheduled,
            block_copies=kv.take_pending_copies(),
            preempted=preempted,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
            released_seq_ids=kv.take_released(),
            finished_seq_ids=self._take_finished(),
        )

    def _take_finished(self) -> list[int]:
        out, self._finished_ids = self._finished_ids, []
        return out

    def _swap_in(self, steps: list[tuple[SequenceState, int]], budget: int) -> int:
        """Bring back swapped groups, oldest first, while their blocks and seats fit.

        A group comes back whole when the pool holds its blocks plus room for all its
        uncomputed tokens and one copy-on-write per sequence; its tokens are scheduled from
        what is left of the budget (a long rest of a prefill continues in later steps). A group
        that could not fit even in an empty pool is recomputed instead.
        """
        kv = self.kv_cache_manager
        while self.swapped and budget > 0:
            group = self.swapped[0]
            chunk = self.config.max_num_batched_tokens
            blocks = kv.num_swap_in_blocks(group) + sum(
                kv.num_blocks_to_resume(s, chunk) for s in group)
            if blocks > kv.num_usable_blocks:  # could never come back: recompute it instead
                self.swapped.pop(0)
                for seq in group:
                    kv.free(seq)
                    self._requeue_for_recompute(seq)
                continue
            if blocks > kv.num_free_blocks or (
                self.running and len(self.running) + len(group) > self.config.max_num_seqs
            ) or not self._lora_fits(group[0], self._running_loras()):
                break
            self.swapped.pop(0)
            if not kv.swap_in(group):  # not an assert: `python -O` would drop the call
                raise RuntimeError(f"swap-in of {len(group)} sequences failed after the fit check")
            for seq in group:
                seq.status = SequenceStatus.RUNNING
                self._insert_running(seq)
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if n > 0:
                    if not kv.allocate_slots(seq, n):
                        raise RuntimeError(f"seq {seq.seq_id}: no blocks after the swap-in check")
                    steps.append((seq, n))
                    budget -= n
        return budget

    def _admit_waiting(self, steps: list[tuple[SequenceState, int]], budget: int) -> int:
        """Admit waiting sequences FCFS with prefill chunks from what is left of the budget.

        With prefix caching, a sequence whose first missed block is being computed this step by
        another one waits a step (later ones may go ahead): it will then hit that block. The
        waiting members of a lockstep request (a beam search recomputed whole) are admitted
        together or not at all.
        """
        kv = self.kv_cache_manager
        in_flight: set[int] | None = None
        i = 0
        loras = self._running_loras()
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[i]
            if not self._lora_fits(seq, loras):
                i += 1
                continue
            self._set_context_regime(seq)
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(seq)
            missed = kv.first_missed_block_hash(seq, hit_blocks)
            if missed is not None:
                if in_flight is None:
                    in_flight = {h for t, n in steps for h in kv.hashes_filled_by(t, n)}
                if missed in in_flight:
                    i += 1
                    continue
            num_new = seq.num_tokens - seq.num_computed_tokens - num_hit_tokens
            if seq.num_preemptions and not self._fits_whole(seq, num_hit_tokens):
                break  # readmitted now, it would be preempted again before its prefill ends
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if seq.request_id in self._lockstep:
                group = [s for s in self.waiting if s.request_id == seq.request_id]
                if len(group) > 1:
                    admitted = self._admit_group(group, steps, budget, in_flight)
                    if admitted is None:
                        break
                    budget = admitted
                    if seq.lora_int_id:
                        loras.add(seq.lora_int_id)
                    continue
            if not kv.allocate_slots(seq, num_new, hit_blocks or None):
                break
            del self.waiting[i]
            self._start_running(seq, num_hit_tokens)
            if seq.lora_int_id:
                loras.add(seq.lora_int_id)
            steps.append((seq, num_new))
            budget -= num_new
            if in_flight is not None:
                in_flight.update(kv.hashes_filled_by(seq, num_new))
        return budget

    def _running_loras(self) -> set[int]:
        """The adapters of the running sequences (empty with LoRA off)."""
        if not self.config.max_loras:
            return set()
        return {s.lora_int_id for s in self.running if s.lora_int_id}

    def _lora_fits(self, seq: SequenceState, loras: set[int]) -> bool:
        """Whether `seq` may run beside the running adapters `loras` (max_loras slots)."""
        return (not seq.lora_int_id or seq.lora_int_id in loras
                or len(loras) < self.config.max_loras)

    def _fits_whole(self, seq: SequenceState, num_hit_tokens: int) -> bool:
        """A sequence preempted by recompute comes back only when the free blocks hold its
        whole length (at its peak over the KV cache groups), not just its first chunk: else
        the running ones grow into the blocks its chunks took, it is the newest and is
        preempted again, and every round recomputes its first chunks for nothing (measured:
        56 preemptions for 8 requests of 8k tokens, benchmarks/hybrid_kv_cache.py). The oldest
        waiting sequence still comes in once the running ones drain: it fits the empty pool."""
        kv = self.kv_cache_manager
        need = kv.peak_blocks(seq.num_tokens, self.config.max_num_batched_tokens)
        return need - num_hit_tokens // kv.block_size <= kv.num_free_blocks

    def _start_running(self, seq: SequenceState, num_hit_tokens: int) -> None:
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_hit_tokens
        seq.num_computed_tokens += num_hit_tokens
        seq.status = SequenceStatus.RUNNING
        self._insert_running(seq)

    def _admit_group(
        self, group: list[SequenceState], steps: list[tuple[SequenceState, int]], budget: int,
        in_flight: set[int] | None,
    ) -> int | None:
        """Admit a lockstep group's waiting sequences together; None (nothing changed) if the
        pool or the seat cap is short. Members get prefill chunks in order from the budget (a
        member left without budget is running with nothing scheduled yet: it is served next
        step like any running prefill)."""
        kv = self.kv_cache_manager
        if self.running and len(self.running) + len(group) > self.config.max_num_seqs:
            return None
        plans = []
        left = budget
        for seq in group:
            self._set_context_regime(seq)
            hits, num_hit_tokens = kv.get_computed_blocks(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens - num_hit_tokens, left)
            plans.append((seq, hits, num_hit_tokens, n))
            left -= n
        if kv.num_blocks_to_admit([(s, h, n) for s, h, _, n in plans]) > kv.num_free_blocks:
            return None
        # Pin every member's prefix hits first, so that no member's fresh blocks evict a block
        # that a later member was counted as hitting; then allocate the chunks.
        for seq, hits, num_hit_tokens, n in plans:
            self.waiting.remove(seq)
            if hits and not kv.allocate_slots(seq, 0, hits):
                raise RuntimeError(f"seq {seq.seq_id}: prefix hits could not be pinned")
            self._start_running(seq, num_hit_tokens)
        for seq, hits, num_hit_tokens, n in plans:
            if not kv.allocate_slots(seq, n):  # checked above: a bug if it fails
                raise RuntimeError(f"seq {seq.seq_id}: no blocks after the group's fit check")
            if n > 0:
                steps.append((seq, n))
            if in_flight is not None:
                in_flight.update(kv.hashes_filled_by(seq, n))
        return left

    def update_after_step(self, output: SchedulerOutput,
                          num_accepted: dict[int, int] | None = None) -> None:
        """Mark this step's tokens computed and publish blocks they filled to the prefix cache.

        `num_accepted` (speculative decoding): seq id -> how many of its draft tokens the
        target accepted; the rejected ones are not computed and the blocks only they used go
        back (`KVCacheManager.trim`), so the tables are exactly what the accepted tokens need.
        Sequences finished since `schedule` (aborted mid-step) are skipped: their blocks are gone.
        """
        kv = self.kv_cache_manager
        for entry in output.scheduled:
            seq = entry.seq
            if seq.is_finished:
                continue
            seq.num_computed_tokens += len(entry.token_ids)
            seq.spec_token_ids = []
            if entry.draft_token_ids:
                accepted = (num_accepted or {}).get(seq.seq_id, 0)
                if not 0 <= accepted <= len(entry.draft_token_ids):
                    raise ValueError(f"seq {seq.seq_id}: {accepted} of {len(entry.draft_token_ids)} "
                                     "draft tokens accepted")
                seq.num_computed_tokens -= len(entry.draft_token_ids) - accepted
                # the accepted drafts and the token sampled after them: num_computed + 1 slots
                kv.trim(seq, seq.num_computed_tokens + 1)
            kv.cache_full_blocks(seq)

    # ---- finishing ------------------------------------------------------------------------

    def finish_sequence(self, seq: SequenceState, status: SequenceStatus) -> None:
        """Finish `seq` with `status`, wherever it is, and free its blocks at once."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.SWAPPED:
            group = next(g for g in self.swapped if seq in g)
            group.remove(seq)
            if not group:
                self.swapped.remove(group)
        elif seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        self._finished_ids.append(seq.seq_id)
        self.kv_cache_manager.free(seq)
        seqs = self._requests.get(seq.request_id)
        if seqs is not None:
            seqs.remove(seq)
            if not seqs:
                del self._requests[seq.request_id]
                del self._request_order[seq.request_id]
                self._lockstep.discard(seq.request_id)

    def abort_request(self, request_id: str) -> list[SequenceState]:
        """Finish every unfinished sequence of the request as aborted; returns them."""
        seqs = list(self._requests.get(request_id, ()))
        for seq in seqs:
            self.finish_sequence(seq, SequenceStatus.FINISHED_ABORTED)
        return seqs

    # ---- counts ---------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        """Sequences whose blocks are in host memory now."""
        return sum(len(g) for g in self.swapped)

    def all_unfinished(self) -> list[SequenceState]:
        return self.running + list(self.waiting) + [s for g in self.swapped for s in g]

    def get_sequence_count(self) -> tuple[int, int]:
        """(running, waiting), like vLLM's `get_request_counts`."""
        return len(self.running), len(self.waiting)

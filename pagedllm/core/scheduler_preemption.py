"""Preemption: who gives up its blocks when a running sequence cannot get one, and how.

A request with several running sequences (n > 1, beam search) is swapped out whole to host
memory, keeping its sharing, and swapped back in whole before new arrivals; a single sequence
(or a lockstep group the host pool cannot take) is recomputed: its blocks freed, it is requeued
at the front of the waiting queue. A sequence that grows past `long_context_after` is recomputed
in the long-context regime the same way. Apart from admission and the step loop because these
are the moves the liveness argument (core/scheduler.py's docstring) reasons about.
"""

from __future__ import annotations

import bisect

from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.core.scheduler_queues import SchedulerQueues


class SchedulerPreemption(SchedulerQueues):
    """Preempt by swap or recompute, and bring swapped groups back."""

    def _preempt_by_recompute(self, seq: SequenceState) -> None:
        """Free its blocks and requeue it ahead of new arrivals.

        Its output tokens are kept: it resumes as a prefill of prompt + output so far. Preempted
        sequences sit at the front of the waiting queue, oldest first.
        """
        self.kv_cache_manager.free(seq)
        self.encoder_cache.release_all(seq)
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
            self.encoder_cache.release_all(s)
            self.num_long_context_recomputes += 1
            self._requeue_for_recompute(s)
        return group

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
                    self.encoder_cache.release_all(seq)
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

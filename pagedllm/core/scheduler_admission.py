"""Admission: which waiting sequences start this step, with how many prefill tokens.

FCFS (or by priority) from what is left of the token budget, waiting a step for a prefix block
another sequence is computing, admitting a lockstep group (beam search) whole or not at all,
and readmitting a recomputed sequence only once its whole length fits. Apart from the step loop
because these rules decide when a request first gets blocks, which the liveness argument
(core/scheduler.py's docstring) rests on.
"""

from __future__ import annotations

from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.core.scheduler_queues import SchedulerQueues


class SchedulerAdmission(SchedulerQueues):
    """Admit waiting sequences (and lockstep groups) into `running`."""

    def _set_context_regime(self, seq: SequenceState) -> None:
        """Before a sequence's first block is looked up or computed: its regime from its length."""
        if seq.num_computed_tokens == 0:
            limit = self.config.long_context_after
            seq.long_context = limit is not None and seq.num_tokens > limit

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
            if seq.mm_features:  # the images the chunk overlaps must have their rows
                num_new = self.encoder_cache.fit_chunk(seq, seq.num_computed_tokens + num_hit_tokens, num_new)
                if num_new <= 0:
                    self.encoder_cache.release_all(seq)
                    break
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
                self.encoder_cache.release_all(seq)
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
            if seq.mm_features:
                n = self.encoder_cache.fit_chunk(seq, seq.num_computed_tokens + num_hit_tokens, n)
            plans.append((seq, hits, num_hit_tokens, n))
            left -= n
        if kv.num_blocks_to_admit([(s, h, n) for s, h, _, n in plans]) > kv.num_free_blocks:
            for seq in group:
                self.encoder_cache.release_all(seq)
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

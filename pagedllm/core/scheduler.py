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

Here: the step loop (`schedule`, `update_after_step`), forks and finishing. The queue order is
in core/scheduler_queues.py, admission in core/scheduler_admission.py, preemption (swap,
recompute) and the swap-in in core/scheduler_preemption.py.
"""
from __future__ import annotations

from collections import deque

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.encoder_cache import EncoderCacheManager
from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.multimodal.inputs import runs_in
from pagedllm.core.scheduler_admission import SchedulerAdmission
from pagedllm.core.scheduler_config import SchedulerConfig, check_request_fits_pool
from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.core.scheduler_preemption import SchedulerPreemption


class Scheduler(SchedulerAdmission, SchedulerPreemption):
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
        # Image inputs: which images' rows the runner holds, and each step's encoder work.
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_size, config.max_num_encoder_input_tokens)

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
    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.config.max_num_batched_tokens
        steps: list[tuple[SequenceState, int]] = []  # (seq, num_new_tokens), in emission order
        preempted: list[int] = []
        self.encoder_cache.begin_step()

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
            if seq.mm_features and num_new > 0 and seq.num_computed_tokens < seq.prompt_len:
                num_new = self.encoder_cache.fit_chunk(seq, seq.num_computed_tokens, num_new)
            if num_new <= 0:  # nothing to run until the engine appends a token (or its image's rows)
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
                mm_runs=runs_in(seq.mm_features, seq.num_computed_tokens, seq.num_computed_tokens + known)
                if seq.mm_features else [],
            ))
        swap_out, swap_in = kv.take_pending_swaps()
        encoder_inputs, freed_encoder_hashes = self.encoder_cache.take_step()
        return SchedulerOutput(
            scheduled=scheduled,
            block_copies=kv.take_pending_copies(),
            preempted=preempted,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
            released_seq_ids=kv.take_released(),
            finished_seq_ids=self._take_finished(),
            encoder_inputs=encoder_inputs,
            freed_encoder_hashes=freed_encoder_hashes,
        )

    def _take_finished(self) -> list[int]:
        out, self._finished_ids = self._finished_ids, []
        return out

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
            if seq.mm_features:
                self.encoder_cache.release_passed(seq)

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
        self.encoder_cache.release_all(seq)
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

"""A torch-free simulation of the engine over core/: the scheduler driven as LLMEngine drives it.

`CoreSim.step` is one engine step without a model: schedule, apply the swaps and copies to a
fake KV store (token ids per slot, so a lost or misplaced block shows), mark the tokens
computed, then do what the engine does with each sampled row: plain requests append a token,
an n > 1 request forks its samples at the first one, and beam searches wait until every running
beam of the request has its row (siblings wait for each other, as `BeamSearchRequest.ready`),
then fork the beams chosen twice, drop the ones not chosen and append a token to the rest.
After every step the block invariants of DESIGN.md are checked, and so is progress: a step
with unfinished requests that schedules nothing and moves no block counts as idle.

The store writes through the runner's own `BlockTable`, kept by the scheduler's deltas alone
(`blocks_from` / `new_block_ids`, `released_seq_ids`), and every step checks it against the
scheduler's view: a scheduled sequence's row equals its table, any other row its synced part.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pagedllm.core.kv_cache_groups import KVCacheGroups
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_config import SchedulerConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.worker.block_table import BlockTable

SWAPPED = SequenceStatus.SWAPPED


class FakeStore:
    """Token ids in device and host slots; applies swaps and copies in the runner's order.

    One runner table per KV cache group (hybrid: each group's blocks hold the same tokens for
    its own layers; a sliding group's dead entries are null in the manager and stale, never
    read, in the runner)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.dev: dict[tuple[int, int], int] = {}  # (group, slot) -> token
        self.host: dict[tuple[int, int], int] = {}
        self.tables = [BlockTable(4, num_rows=2) for _ in kv.groups]  # the runner's copies

    def _live_ids(self, ids: list[int], g: int, table: list) -> list[int | None]:
        """The manager's ids with null entries blanked (the runner may hold anything there)."""
        null = self.kv.null_block
        return [None if b is null else i for i, b in zip(ids, table)]

    def _same(self, runner: list[int], g: int, table: list) -> bool:
        mine = self._live_ids([b.block_id for b in table], g, table)
        return len(runner) == len(mine) and all(m is None or m == r for r, m in zip(runner, mine))

    def execute(self, out: SchedulerOutput) -> None:
        B = self.kv.block_size

        def move(pairs, src_store, dst_store):
            snapshot = dict(src_store)
            for src, dst in pairs:
                for g in range(len(self.kv.groups)):
                    for off in range(B):
                        dst_store.pop((g, dst * B + off), None)
                        if (g, src * B + off) in snapshot:
                            dst_store[(g, dst * B + off)] = snapshot[(g, src * B + off)]

        for seq_id in out.released_seq_ids:
            for t in self.tables:
                t.release(seq_id)
        rows = {}
        for s in out.scheduled:
            sid = s.seq.seq_id
            deltas = ((s.blocks_from, s.new_block_ids),) + s.group_deltas
            assert len(deltas) == len(self.kv.groups)
            rows[sid] = [t.apply(sid, start, ids) for t, (start, ids) in zip(self.tables, deltas)]
        for s in out.scheduled:  # the runner's tables are the scheduler's
            for g, t in enumerate(self.tables):
                table = self.kv.tables[g][s.seq.seq_id]
                assert self._same(t.ids(s.seq.seq_id), g, table), (g, s.seq.seq_id)
        move(out.blocks_to_swap_out, self.dev, self.host)
        move(out.blocks_to_swap_in, self.host, self.dev)
        assert len({d for _, d in out.block_copies}) == len(out.block_copies)  # no race
        move(out.block_copies, self.dev, self.dev)
        for s in out.scheduled:
            for g, t in enumerate(self.tables):
                for i, tok in enumerate(s.token_ids):
                    pos = s.start_pos + i
                    block_id = int(t.tensor[rows[s.seq.seq_id][g], pos // B])
                    block = self.kv.block_pool.blocks[block_id]
                    assert block is not self.kv.null_block, (g, s.seq.seq_id, pos)
                    assert block.ref_count == 1 and block.block_hash is None, (  # invariant 3
                        g, s.seq.seq_id, pos, s.start_pos, len(s.token_ids), block,
                        [b.block_id for b in self.kv.tables[g][s.seq.seq_id]])
                    self.dev[(g, block.block_id * B + pos % B)] = tok

    def check(self, sched: Scheduler) -> None:
        B = self.kv.block_size
        live = {s.seq_id for s in sched.all_unfinished()}
        null = self.kv.null_block
        for g, synced_of in enumerate(self.kv.synced):
            for seq_id, synced in synced_of.items():  # rows kept between steps
                assert seq_id in live, f"seq {seq_id}: a synced table after it finished"
                table = self.kv.tables[g][seq_id][:synced]
                assert self._same(self.tables[g].ids(seq_id)[:synced], g, table), (g, seq_id)
        for s in sched.all_unfinished():
            for g, group in enumerate(self.kv.groups):
                if s.status == SWAPPED:
                    table, store = self.kv.host_tables[g][s.seq_id], self.host
                else:
                    table, store = self.kv.tables[g].get(s.seq_id, []), self.dev
                first = group.first_live_position(s.num_computed_tokens)
                for pos, tok in enumerate(s.all_token_ids[: s.num_computed_tokens]):
                    if pos < first:  # no query reads it: the block may be gone
                        continue
                    block = table[pos // B]
                    assert block is not null, (g, s.seq_id, pos)
                    assert store.get((g, block.block_id * B + pos % B)) == tok, (g, s.seq_id, pos)


@dataclass
class SimRequest:
    request_id: str
    kind: str  # "plain" | "n" (n > 1 samples) | "beam"
    width: int  # n, or the beam width
    max_tokens: int
    arrival_step: int
    priority: int = 0  # the "priority" policy's key (lower = earlier)
    seqs: list[SequenceState] = field(default_factory=list)  # every sequence ever made
    beams: list[SequenceState] = field(default_factory=list)  # the running beams (beam search)
    pending: set[int] = field(default_factory=set)  # beams whose row is in (BeamSearchRequest)
    num_generated: int = 0  # beam steps taken
    forked: bool = False
    finished_step: int | None = None
    aborted: bool = False

    @property
    def done(self) -> bool:
        return self.finished_step is not None


class Stalled(AssertionError):
    """The scheduler had unfinished work and went `max_idle` steps without any progress."""


class CoreSim:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        enable_caching: bool = True,
        preemption_mode: str | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 64,
        max_model_len: int = 64,
        seed: int = 0,
        max_idle: int = 3,
        stop_prob: float = 0.03,
        policy: str = "fcfs",
        groups: KVCacheGroups | None = None,
    ) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching, num_host_blocks, groups)
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len, preemption_mode=preemption_mode,
                            policy=policy),
            self.kv,
        )
        self.store = FakeStore(self.kv)
        self.rng = random.Random(seed)
        self.max_idle = max_idle
        self.stop_prob = stop_prob  # chance that a sample (or a beam step) ends its request
        self.requests: dict[str, SimRequest] = {}
        self.num_rejected = 0
        self.t = 0
        self.idle_streak = 0
        self.counts = {"steps": 0, "preempted": 0, "swap_out": 0, "swap_in": 0, "aborted": 0}
        self._ids = iter(range(10**9))

    # ---- requests --------------------------------------------------------------------------

    def add(self, kind: str, prompt: list[int], max_tokens: int, width: int = 1,
            salt: str | None = None, priority: int = 0) -> SimRequest | None:
        """Queue a request as `LLMEngine.add_request` does; None if it was rejected there."""
        try:
            self.sched.check_request_fits(len(prompt) + max_tokens,
                                          width if kind == "beam" else 1)
        except ValueError:
            self.num_rejected += 1
            return None
        rid = f"{kind}{next(self._ids)}"
        req = SimRequest(rid, kind, width, max_tokens, self.t, priority)
        seq = self._new_seq(req, prompt, [], index=0, salt=salt)
        self.sched.add_sequence(seq, lockstep=kind == "beam")
        if kind == "beam":
            req.beams = [seq]
        self.requests[rid] = req
        return req

    def _new_seq(self, req: SimRequest, prompt, output, index: int, salt=None) -> SequenceState:
        seq = SequenceState(seq_id=next(self._ids), request_id=req.request_id,
                       prompt_token_ids=list(prompt), arrival_time=float(req.arrival_step),
                       index=index, cache_salt=salt, output_token_ids=list(output),
                       priority=req.priority)
        req.seqs.append(seq)
        return seq

    def abort(self, req: SimRequest) -> None:
        self.sched.abort_request(req.request_id)
        req.aborted = True
        req.finished_step = self.t
        self.counts["aborted"] += 1

    def unfinished(self) -> list[SimRequest]:
        return [r for r in self.requests.values() if not r.done]

    # ---- one engine step -------------------------------------------------------------------

    def step(self) -> SchedulerOutput:
        self.t += 1
        out = self.sched.schedule()
        self.counts["steps"] += 1
        self.counts["preempted"] += len(out.preempted)
        self.counts["swap_out"] += len(out.blocks_to_swap_out)
        self.counts["swap_in"] += len(out.blocks_to_swap_in)
        self.kv.check_invariants(self.sched.all_unfinished())
        if self.unfinished() and out.is_empty and not out.has_cache_ops:
            self.idle_streak += 1
            if self.idle_streak >= self.max_idle:
                raise Stalled(self.describe())
        else:
            self.idle_streak = 0
        self.store.execute(out)
        self.sched.update_after_step(out)
        for item in out.scheduled:
            if item.sample and not item.seq.is_finished:
                self._on_row(self.requests[item.seq.request_id], item.seq)
        for req in self.unfinished():
            if all(s.is_finished for s in req.seqs) and (req.forked or req.kind != "n"):
                req.finished_step = self.t
        self.kv.check_invariants(self.sched.all_unfinished())
        self.store.check(self.sched)
        return out

    def _on_row(self, req: SimRequest, seq: SequenceState) -> None:
        rng = self.rng
        if req.kind == "beam":
            req.pending.add(seq.seq_id)
            if all(b.seq_id in req.pending and b.status == SequenceStatus.RUNNING
                   and b.num_computed_tokens == b.num_tokens for b in req.beams):
                self._advance_beams(req)
            return
        targets = [seq]
        if req.kind == "n" and not req.forked:
            for i in range(1, req.width):
                child = self._new_seq(req, seq.prompt_token_ids, [], index=i,
                                      salt=seq.cache_salt)
                child.num_computed_tokens = seq.num_computed_tokens
                self.sched.fork_sequence(seq, child)
                targets.append(child)
            req.forked = True
        for s in targets:
            s.append_token(rng.randrange(4))
            if s.num_output_tokens >= req.max_tokens:
                self.sched.finish_sequence(s, SequenceStatus.FINISHED_LENGTH)
            elif rng.random() < self.stop_prob:
                self.sched.finish_sequence(s, SequenceStatus.FINISHED_STOPPED)

    def _advance_beams(self, req: SimRequest) -> None:
        """`BeamSearchRequest.advance` with random choices: each of `width` continuations
        extends a random running beam; chosen twice means forked, never chosen means dropped."""
        rng = self.rng
        parents = req.beams
        req.pending.clear()
        req.num_generated += 1
        done = req.num_generated >= req.max_tokens or rng.random() < self.stop_prob
        chosen: list[SequenceState] = []
        kept: set[int] = set()
        if not done:
            for _ in range(req.width):
                parent = parents[rng.randrange(len(parents))]
                if parent.seq_id in kept:
                    child = self._new_seq(req, parent.prompt_token_ids, parent.output_token_ids,
                                          index=0, salt=parent.cache_salt)
                    self.sched.fork_sequence(parent, child)
                    chosen.append(child)
                else:
                    kept.add(parent.seq_id)
                    chosen.append(parent)
        for parent in parents:
            if parent.seq_id not in kept:
                self.sched.finish_sequence(parent, SequenceStatus.FINISHED_ABORTED)
        for s in chosen:
            s.append_token(rng.randrange(4))
        req.beams = chosen

    # ---- running ---------------------------------------------------------------------------

    def run_until_drained(self, max_steps: int) -> None:
        while self.unfinished():
            if self.t >= max_steps:
                raise Stalled(f"not drained in {max_steps} steps: {self.describe()}")
            self.step()

    def assert_drained(self) -> None:
        kv = self.kv
        assert not self.sched.has_unfinished()
        assert all(s.is_finished for r in self.requests.values() for s in r.seqs)
        assert kv.num_free_blocks == kv.num_usable_blocks and kv.num_shared_blocks == 0
        assert kv.host_pool is None or kv.num_free_host_blocks == kv.host_pool.num_blocks
        assert self.counts["swap_out"] == kv.num_swapped_out
        assert self.counts["swap_in"] == kv.num_swapped_in
        assert self.counts["preempted"] == self.sched.num_preemptions
        kv.check_invariants([])

    def describe(self) -> str:
        s = self.sched
        parts = [f"step {self.t}: free {self.kv.num_free_blocks}/{self.kv.num_blocks}, "
                 f"host free {self.kv.num_free_host_blocks}"]
        for name, seqs in (("running", s.running), ("waiting", list(s.waiting)),
                           ("swapped", [x for g in s.swapped for x in g])):
            parts.append(name + ": " + ", ".join(
                f"{x.request_id}/{x.seq_id}({x.num_computed_tokens}/{x.num_tokens})"
                for x in seqs))
        return "; ".join(parts)

"""The stored-token count of the KV statistics: the per-sequence shortcut equals the full walk of
every block table, through prefix hits, forks, copy-on-write, preemption and finishes."""

import random

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_config import SchedulerConfig
from pagedllm.engine.kv_stats import KVCacheStatsTracker

_ids = iter(range(10**9))


def seq(prompt, request_id=None) -> SequenceState:
    sid = next(_ids)
    return SequenceState(seq_id=sid, request_id=request_id or f"r{sid}", prompt_token_ids=list(prompt),
                    arrival_time=float(sid))


def both_counts(sched: Scheduler, kv: KVCacheManager) -> tuple[int, int]:
    fast = KVCacheStatsTracker.stored_tokens(sched.running, kv.req_to_blocks, kv.block_size,
                                             kv.num_shared_blocks)
    walk = KVCacheStatsTracker.count_stored_tokens(sched.running, kv.get_block_ids, kv.block_size)
    return fast, walk


def test_unshared_tables_need_no_walk():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = seq(range(10)), seq(range(50, 55))
    for s, n in ((a, 10), (b, 5)):
        assert kv.allocate_slots(s, n)
    a.num_computed_tokens, b.num_computed_tokens = 7, 5  # a: 3 blocks, 7 tokens computed
    assert KVCacheStatsTracker.stored_tokens([a, b], kv.req_to_blocks, 4, 0) == 12
    assert KVCacheStatsTracker.count_stored_tokens([a, b], kv.get_block_ids, 4) == 12


def test_shared_block_behind_an_unshared_one_falls_back_to_the_walk():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a, b = seq([1, 2, 3, 4]), seq([1, 2, 3, 4])
    assert kv.allocate_slots(a, 4) and kv.allocate_slots(b, 2)
    a.num_computed_tokens, b.num_computed_tokens = 4, 2
    kv.req_to_blocks[b.seq_id].append(kv.req_to_blocks[a.seq_id][1])  # b: [own, a's second]
    kv.block_pool.touch([kv.req_to_blocks[a.seq_id][1]])
    b.num_computed_tokens = 4
    fast = KVCacheStatsTracker.stored_tokens([a, b], kv.req_to_blocks, 2, kv.num_shared_blocks)
    assert fast == KVCacheStatsTracker.count_stored_tokens([a, b], kv.get_block_ids, 2) == 6


def test_random_engine_like_runs_match_the_full_walk():
    rng = random.Random(1)
    for trial in range(30):
        block_size = rng.choice([1, 2, 4, 16])
        kv = KVCacheManager(num_blocks=rng.randint(20, 60), block_size=block_size,
                            enable_caching=rng.random() < 0.8)
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=rng.choice([8, 32, 128]),
                                          max_num_seqs=rng.choice([4, 16])), kv)
        systems = [[rng.randrange(100, 200) for _ in range(rng.randint(0, 3 * block_size + 1))]
                   for _ in range(3)]
        budget = {}
        for i in range(rng.randint(3, 12)):
            s = seq(rng.choice(systems) + [rng.randrange(100, 200) for _ in range(rng.randint(1, 9))])
            budget[s.seq_id] = rng.randint(1, 12)
            sched.add_sequence(s)
        for _ in range(300):
            if not sched.has_unfinished():
                break
            out = sched.schedule()
            sched.update_after_step(out)
            fast, walk = both_counts(sched, kv)
            assert fast == walk, (trial, fast, walk)
            for item in out.scheduled:
                s = item.seq
                if not item.sample or s.is_finished:
                    continue
                s.append_token(rng.randrange(100, 200))
                if rng.random() < 0.15 and len(sched.running) < 16:  # fork, as n > 1 and beams do
                    child = seq([], request_id=s.request_id)
                    child.prompt_token_ids = list(s.prompt_token_ids)
                    child.output_token_ids = list(s.output_token_ids)
                    budget[child.seq_id] = budget[s.seq_id]
                    sched.fork_sequence(s, child)
                if s.num_output_tokens >= budget[s.seq_id]:
                    sched.finish_sequence(s, SequenceStatus.FINISHED_LENGTH)
            fast, walk = both_counts(sched, kv)
            assert fast == walk, (trial, fast, walk)

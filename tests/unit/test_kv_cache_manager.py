"""KVCacheManager: exact block ids, prefix hits, salt, fork + CoW, capacity, invariants."""

import random

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import SequenceState

_next_id = iter(range(10**9))


def make_seq(prompt, output=(), salt=None) -> SequenceState:
    sid = next(_next_id)
    return SequenceState(
        seq_id=sid,
        request_id=f"r{sid}",
        prompt_token_ids=list(prompt),
        arrival_time=float(sid),
        cache_salt=salt,
        output_token_ids=list(output),
    )


def run(kv: KVCacheManager, seq: SequenceState, num_new: int | None = None) -> list[int]:
    """Allocate (with prefix lookup for a fresh seq), mark computed, cache; returns block ids."""
    hits, num_hit = kv.get_computed_blocks(seq) if seq.num_computed_tokens == 0 else ([], 0)
    if num_new is None:
        num_new = seq.num_tokens - seq.num_computed_tokens - num_hit
    assert kv.allocate_slots(seq, num_new, hits or None)
    seq.num_computed_tokens += num_hit + num_new
    kv.cache_full_blocks(seq)
    return kv.get_block_ids(seq.seq_id)


def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_count for b in kv.block_pool.blocks] + [0] * kv.block_pool.num_fresh


@pytest.mark.parametrize("B", [8, 16, 32])
def test_allocation_across_block_boundaries(B):
    kv = KVCacheManager(num_blocks=10, block_size=B)
    a = make_seq(range(B + 1))
    b = make_seq(range(100, 100 + B))
    assert run(kv, a) == [0, 1]
    assert run(kv, b) == [2]
    assert kv.num_blocks_needed(B + 1) == 2 and kv.num_blocks_needed(B) == 1
    # Decode a until its second block is full: no new block.
    while a.num_tokens < 2 * B:
        a.append_token(7)
        assert run(kv, a) == [0, 1]
    a.append_token(7)  # position 2B opens a third block
    assert run(kv, a) == [0, 1, 3]
    b.append_token(7)  # position B opens b's second block
    assert run(kv, b) == [2, 4]
    assert kv.num_free_blocks == 5 and kv.usage == pytest.approx(0.5)
    kv.check_invariants([a, b])
    kv.free(a)
    kv.free(a)  # idempotent
    kv.free(b)
    assert kv.num_free_blocks == 10 and all(r == 0 for r in refs(kv))
    assert kv.get_block_ids(a.seq_id) == []
    kv.check_invariants([])


def test_chunked_allocation_grows_table():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = make_seq(range(10))
    assert run(kv, s, 3) == [0]
    assert run(kv, s, 3) == [0, 1]
    assert run(kv, s, 4) == [0, 1, 2]
    assert s.num_computed_tokens == 10


def test_prefix_hit_full_blocks_only_and_last_token_recomputed():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = make_seq(prompt)
    assert run(kv, a) == [0, 1, 2]
    assert kv.block_pool.blocks[2].block_hash is None  # partial block: never hashed

    b = make_seq(prompt)
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert refs(kv)[:3] == [1, 1, 1]  # lookup takes no reference
    assert kv.allocate_slots(b, 2, hits)
    b.num_computed_tokens = 10
    assert kv.get_block_ids(b.seq_id) == [0, 1, 3]
    assert refs(kv)[:4] == [2, 2, 1, 1] and kv.num_shared_blocks == 2
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)

    # Exactly two full blocks: only the first can hit (the last token is recomputed).
    c = make_seq(prompt[:8])
    assert kv.get_computed_blocks(c)[1] == 4
    # Divergence in the second block: only the first hits.
    d = make_seq(prompt[:4] + [99] + prompt[5:])
    assert [h.block_id for h in kv.get_computed_blocks(d)[0]] == [0]
    # Same second block after a different first block: no hit (hashes chain).
    e = make_seq([99] + prompt[1:])
    assert kv.get_computed_blocks(e) == ([], 0)
    kv.check_invariants([a, b])


def test_prefix_hit_after_owner_is_freed():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    prompt = list(range(9))
    a = make_seq(prompt)
    assert run(kv, a) == [0, 1, 2]
    kv.free(a)  # tail first: 2 is evicted before 1 before 0
    assert list(kv.block_pool.free_block_ids()) == [3, 4, 5, 2, 1, 0]
    b = make_seq(prompt + [50])
    assert run(kv, b) == [0, 1, 3]
    assert list(kv.block_pool.free_block_ids()) == [4, 5, 2]
    kv.check_invariants([b])


def test_generated_tokens_fill_a_cacheable_block():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_seq([1, 2, 3])
    run(kv, a)
    a.append_token(4)  # sampled: fills block 0, but is not computed yet
    kv.cache_full_blocks(a)
    assert kv.block_pool.blocks[0].block_hash is None
    run(kv, a)  # the decode step computes it
    assert kv.block_pool.blocks[0].block_hash is not None
    b = make_seq([1, 2, 3, 4, 6])
    assert kv.get_computed_blocks(b)[1] == 4


def test_cache_salt_isolation():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(9))
    run(kv, make_seq(prompt, salt="alice"))
    assert kv.get_computed_blocks(make_seq(prompt, salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_seq(prompt))[1] == 0
    assert kv.get_computed_blocks(make_seq(prompt, salt="alice"))[1] == 8
    run(kv, make_seq(prompt))
    assert kv.get_computed_blocks(make_seq(prompt))[1] == 8


# CPython hashes an int to itself mod 2**61 - 1, and a tuple from its items' hashes: with the
# builtin `hash` these two blocks collide, so anyone could plant a block another prompt hits.
_MERSENNE_61 = 2**61 - 1


def test_blocks_colliding_under_builtin_hash_do_not_share():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert hash((None, (1, 2, 3, 4), None)) == hash((None, (1, 2, 3, 4 + _MERSENNE_61), None))
    run(kv, make_seq([1, 2, 3, 4 + _MERSENNE_61, 9]))  # the planted block
    victim = make_seq([1, 2, 3, 4, 9])
    assert kv.get_computed_blocks(victim) == ([], 0)
    run(kv, make_seq([1, 2, 3, 4, 9]))
    assert kv.get_computed_blocks(victim)[1] == 4  # its own prefix still hits


def test_second_blocks_colliding_under_builtin_hash_do_not_share():
    """The chain: equal first blocks, then a second block that collides under `hash`."""
    kv = KVCacheManager(num_blocks=10, block_size=2)
    run(kv, make_seq([5, 6, 7 + _MERSENNE_61, 8, 1]))
    hits, n = kv.get_computed_blocks(make_seq([5, 6, 7, 8, 1]))
    assert n == 2 and hits == [kv.block_pool.blocks[0]]


def test_caching_disabled():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False)
    prompt = list(range(9))
    run(kv, make_seq(prompt))
    assert kv.get_computed_blocks(make_seq(prompt)) == ([], 0)
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    assert kv.prefix_cache_queries == 0


def test_fork_and_copy_on_write():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    parent = make_seq(range(6))
    assert run(kv, parent) == [0, 1]
    parent.append_token(10)
    child = make_seq(range(6), output=[11])
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    assert kv.get_block_ids(child.seq_id) == [0, 1]
    assert refs(kv)[:2] == [2, 2] and kv.num_shared_blocks == 2
    kv.check_invariants([parent, child])

    # Parent writes position 6 into shared block 1: copy to a fresh block first.
    assert run(kv, parent) == [0, 2]
    assert kv.take_pending_copies() == [(1, 2)]
    assert kv.take_pending_copies() == []
    assert refs(kv)[:3] == [2, 1, 1]
    # The child is now the only owner of block 1: it writes in place.
    assert run(kv, child) == [0, 1]
    assert kv.take_pending_copies() == []
    kv.check_invariants([parent, child])

    # Block 0 is full and shared, but never in a write range: never copied.
    for tok in (12, 14):
        parent.append_token(tok)
        child.append_token(tok + 1)
        parent_ids, child_ids = run(kv, parent), run(kv, child)
    assert parent_ids == [0, 2, 3] and child_ids == [0, 1, 4]
    assert kv.take_pending_copies() == []
    kv.free(parent)
    kv.free(child)
    assert all(r == 0 for r in refs(kv)) and kv.num_free_blocks == 6
    kv.check_invariants([])


def test_fork_at_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    parent = make_seq(range(8))
    run(kv, parent)
    parent.append_token(1)
    child = make_seq(range(8), output=[2])
    child.num_computed_tokens = 8
    kv.fork(parent, child)
    assert run(kv, parent) == [0, 1, 2] and run(kv, child) == [0, 1, 3]
    assert kv.take_pending_copies() == []
    assert refs(kv)[:4] == [2, 2, 1, 1]


def _snapshot(kv: KVCacheManager):
    return (
        [b.ref_count for b in kv.block_pool.blocks] + [0] * kv.block_pool.num_fresh,
        list(kv.block_pool.free_block_ids()),
        {k: [b.block_id for b in v] for k, v in kv.req_to_blocks.items()},
        list(kv._pending_copies),
    )


def test_capacity_failure_leaves_state_unchanged():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_seq(range(12))
    run(kv, a)  # blocks 0 1 2
    b = make_seq(range(100, 105))
    before = _snapshot(kv)
    assert not kv.allocate_slots(b, 5)  # needs 2, 1 free
    assert _snapshot(kv) == before
    assert kv.allocate_slots(b, 4)


def test_capacity_counts_copy_on_write_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    parent = make_seq(range(6))
    run(kv, parent)  # 0 1
    parent.append_token(9)
    child = make_seq(range(6), output=[8])
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    other = make_seq([5])
    run(kv, other)  # takes the last free block
    before = _snapshot(kv)
    assert not kv.allocate_slots(parent, 1)  # needs a CoW block, none free
    assert _snapshot(kv) == before and kv.take_pending_copies() == []


def test_capacity_counts_touched_free_cached_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_seq(range(8))
    run(kv, a)
    kv.free(a)  # blocks 0 (hashed), 1 (hashed) free; 2 free
    b = make_seq(list(range(8)) + list(range(20, 25)))  # hits 0,1 then needs 2 blocks
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and kv.num_free_blocks == 3
    before = _snapshot(kv)
    assert not kv.allocate_slots(b, 5, hits)  # touching 0,1 leaves 1 free block, not 2
    assert _snapshot(kv) == before
    assert kv.allocate_slots(b, 4, hits)  # fits in exactly one new block
    assert kv.get_block_ids(b.seq_id) == [0, 1, 2] and kv.num_free_blocks == 0


def test_stale_prefix_hits_are_refused():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    a = make_seq(range(3))
    run(kv, a)
    kv.free(a)
    b = make_seq(range(3))
    hits, _ = kv.get_computed_blocks(b)
    run(kv, make_seq([9, 9, 9, 9]))  # takes both blocks, evicting the hit
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 1, hits)


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_seq(range(5))
    run(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.get_computed_blocks(make_seq(range(5)))[1] == 4
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_seq(range(5)))[1] == 0


# ---- randomized: allocate / fork / free / preempt with a fake KV store -------------------------


class FakeKV:
    """What the runner would write: per block, the token at each slot."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.slots = {i: [None] * kv.block_size for i in range(kv.num_blocks)}

    def step(self, seq: SequenceState, start: int, end: int) -> None:
        for src, dst in self.kv.take_pending_copies():  # copies happen before the forward
            self.slots[dst] = list(self.slots[src])
        B = self.kv.block_size
        table = self.kv.req_to_blocks[seq.seq_id]
        for pos in range(start, end):
            block = table[pos // B]
            # Invariant 3: never write a shared block or a full hashed block.
            assert block.ref_count == 1, (seq.seq_id, pos, block)
            assert block.block_hash is None, (seq.seq_id, pos, block)
            self.slots[block.block_id][pos % B] = seq.token_ids_slice(pos, pos + 1)[0]

    def check_content(self, seqs) -> None:
        B = self.kv.block_size
        for seq in seqs:
            ids = self.kv.get_block_ids(seq.seq_id)
            tokens = seq.all_token_ids
            for pos in range(seq.num_computed_tokens):
                assert self.slots[ids[pos // B]][pos % B] == tokens[pos], (seq.seq_id, pos)


@pytest.mark.parametrize("seed", range(6))
def test_randomized_block_table_operations(seed):
    rng = random.Random(seed)
    B = rng.choice([2, 4, 8])
    kv = KVCacheManager(num_blocks=rng.randint(6, 16), block_size=B)
    store = FakeKV(kv)
    max_len = kv.num_blocks * B  # a sequence never outgrows the pool alone
    prefixes = [[rng.randrange(3) for _ in range(rng.randint(1, max_len // 3))] for _ in range(3)]
    active: list[SequenceState] = []

    for _ in range(400):
        op = rng.random()
        if op < 0.2 or not active:
            prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randint(0, 2 * B))]
            active.append(make_seq(prompt, salt=rng.choice([None, None, "s"])))
        elif op < 0.3:
            seq = active.pop(rng.randrange(len(active)))
            kv.free(seq)
        elif op < 0.35:  # preempt by recompute: its tokens stay, its blocks go
            seq = rng.choice(active)
            kv.free(seq)
            seq.num_computed_tokens = 0
        elif op < 0.5:  # fork a sequence after it samples a token (n > 1, beam search)
            parent = rng.choice(active)
            if parent.num_computed_tokens >= parent.prompt_len and not parent.num_uncomputed_tokens:
                parent.append_token(rng.randrange(3))
            if (
                parent.num_computed_tokens >= parent.prompt_len
                and parent.num_tokens == parent.num_computed_tokens + 1
            ):
                child = make_seq(
                    parent.prompt_token_ids,
                    output=parent.output_token_ids[:-1] + [rng.randrange(3)],
                    salt=parent.cache_salt,
                )
                child.num_computed_tokens = parent.num_computed_tokens
                kv.fork(parent, child)
                active.append(child)
        else:  # run a chunk of a sequence, as one step would
            seq = rng.choice(active)
            if seq.num_uncomputed_tokens == 0:
                seq.append_token(rng.randrange(3))
            hits, num_hit = ([], 0)
            if seq.num_computed_tokens == 0:
                hits, num_hit = kv.get_computed_blocks(seq)
            num_new = rng.randint(1, seq.num_tokens - num_hit - seq.num_computed_tokens)
            if seq.num_tokens > max_len or not kv.allocate_slots(seq, num_new, hits or None):
                kv.free(seq)  # out of room: finish it
                active.remove(seq)
            else:
                seq.num_computed_tokens += num_hit
                start = seq.num_computed_tokens
                store.step(seq, start, start + num_new)
                seq.num_computed_tokens += num_new
                kv.cache_full_blocks(seq)
        kv.check_invariants(active)
        store.check_content(active)
        assert sum(refs(kv)) == sum(len(kv.get_block_ids(s.seq_id)) for s in active)

    for seq in active:
        kv.free(seq)
    # Invariant 1: everything back, nothing referenced.
    assert all(r == 0 for r in refs(kv)) and kv.num_free_blocks == kv.num_blocks
    kv.check_invariants([])

"""BlockPool: exact block ids, LRU free order, ref counts, hash map and eviction."""

import itertools

import pytest

from pagedllm.core.block_pool import BlockPool, FreeKVBlockQueue, KVBlock, hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    return list(pool.free_block_ids())


def test_free_queue_o1_operations():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeKVBlockQueue(blocks)
    assert len(q) == 5 and ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    q.remove(blocks[4])
    q.remove(blocks[0])
    assert ids(q) == [1, 3] and len(q) == 2
    assert q.popleft() is blocks[1]
    q.append(blocks[0])
    assert ids(q) == [3, 0]
    with pytest.raises(ValueError):
        q.append(blocks[0])  # already queued
    with pytest.raises(ValueError):
        q.remove(blocks[2])  # not queued
    q.popleft(), q.popleft()
    assert len(q) == 0 and ids(q) == []
    with pytest.raises(ValueError):
        q.popleft()


def test_allocation_order_and_ref_counts():
    pool = BlockPool(8)
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0 and pool.usage == 0.0
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2] and all(b.ref_count == 1 for b in a)
    b = pool.get_new_blocks(2)
    assert ids(b) == [3, 4]
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 5
    assert pool.usage == pytest.approx(5 / 8)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.num_free_blocks == 3  # a failed request takes nothing


def test_free_queue_is_lru_in_the_order_given():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 0 1 2
    b = pool.get_new_blocks(2)  # 3 4
    pool.free_blocks(reversed(a))  # a sequence's blocks go back tail first
    assert free_ids(pool) == [5, 2, 1, 0]
    pool.free_blocks([b[1], b[0]])
    assert free_ids(pool) == [5, 2, 1, 0, 4, 3]
    assert ids(pool.get_new_blocks(4)) == [5, 2, 1, 0]  # least recently freed first


def test_shared_block_is_freed_only_at_zero():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_count == 2
    pool.free_blocks([blk])
    assert blk.ref_count == 1 and 0 not in free_ids(pool)
    pool.free_blocks([blk])
    assert blk.ref_count == 0 and free_ids(pool) == [1, 2, 3, 0]
    with pytest.raises(ValueError):
        pool.free_blocks([blk])


def test_cached_block_survives_free_and_is_hit_again():
    pool = BlockPool(4)
    h = hash_block_tokens(None, [1, 2, 3, 4], None)
    blk, _ = pool.get_new_blocks(2)
    pool.cache_full_block(blk, h)
    assert pool.get_cached_block(h) is blk
    pool.free_blocks([_, blk])  # owner finished: both go back, content kept
    assert free_ids(pool) == [2, 3, 1, 0]
    assert pool.get_cached_block(h) is blk and blk.block_hash == h
    pool.touch([blk])  # a later request hits it: it leaves the free queue
    assert blk.ref_count == 1 and free_ids(pool) == [2, 3, 1]
    assert pool.num_used_blocks == 1


def test_reallocating_a_cached_free_block_evicts_its_hash():
    pool = BlockPool(2)
    h = hash_block_tokens(None, [7, 7], None)
    blk, other = pool.get_new_blocks(2)
    pool.cache_full_block(blk, h)
    pool.free_blocks([blk, other])  # blk is the LRU block
    (new,) = pool.get_new_blocks(1)
    assert new is blk and blk.block_hash is None and blk.ref_count == 1
    assert pool.get_cached_block(h) is None
    assert pool.cached_block_hash_to_block == {}


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(3)
    h = hash_block_tokens(None, [5, 6], None)
    first, dup = pool.get_new_blocks(2)
    pool.cache_full_block(first, h)
    pool.cache_full_block(dup, h)
    assert pool.get_cached_block(h) is first
    assert dup.block_hash is None and first.block_hash == h
    pool.free_blocks([dup])
    pool.get_new_blocks(2)  # reuses 2 and the unhashed duplicate: the cache is untouched
    assert pool.get_cached_block(h) is first


def test_hash_chains_and_salt():
    h0 = hash_block_tokens(None, [1, 2], None)
    assert h0 == hash_block_tokens(None, (1, 2), None)
    assert hash_block_tokens(h0, [3, 4], None) != hash_block_tokens(None, [3, 4], None)
    assert hash_block_tokens(None, [1, 2], ("salt",)) != h0


def test_hash_is_sha256_of_parent_digest_tokens_and_salt():
    import hashlib
    import struct

    h0 = hash_block_tokens(None, [1, 2], None)
    assert isinstance(h0, bytes) and len(h0) == 32
    root = bytes(32)  # the parent of a first block
    assert h0 == hashlib.sha256(root + struct.pack("<I2q", 2, 1, 2)).digest()
    h1 = hash_block_tokens(h0, [3, 4], ("s",))
    assert h1 == hashlib.sha256(h0 + struct.pack("<I2q", 2, 3, 4) + repr(("s",)).encode()).digest()


def test_hash_resists_builtin_hash_collisions():
    p = 2**61 - 1  # hash(x) == hash(x + p) for CPython ints
    assert hash_block_tokens(None, [4], None) != hash_block_tokens(None, [4 + p], None)
    # hash(-1) == hash(-2) in CPython
    assert hash_block_tokens(None, [-1], None) != hash_block_tokens(None, [-2], None)
    # No ambiguity between a block's tokens and its salt, or between block lengths.
    assert hash_block_tokens(None, [1, 2], None) != hash_block_tokens(None, [1], ("x",))
    assert hash_block_tokens(None, [0], None) != hash_block_tokens(None, [0, 0], None)


def test_reset_prefix_cache():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    for i, blk in enumerate(blocks):
        pool.cache_full_block(blk, hash_block_tokens(None, [i], None))
    assert pool.reset_prefix_cache() is False  # blocks in use: refused, nothing dropped
    assert len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free_blocks == 3


def test_caching_disabled_never_hashes():
    pool = BlockPool(2, enable_caching=False)
    h = hash_block_tokens(None, [1], None)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_full_block(blk, h)
    assert blk.block_hash is None and pool.get_cached_block(h) is None


def test_invalid_size():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_blocks_are_made_on_first_use_in_the_same_order():
    """A small model's 4 GiB swap space is millions of blocks: none is made before it is used
    (it took seconds and hundreds of MB per engine), and the order is still fresh ids first,
    then freed blocks, least recently freed first."""
    pool = BlockPool(2_000_000)
    assert pool.blocks == [] and pool.num_free_blocks == 2_000_000 and pool.num_fresh == 2_000_000
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2] and len(pool.blocks) == 3
    pool.free_blocks([a[1]])
    assert list(itertools.islice(pool.free_block_ids(), 2)) == [3, 4]
    assert ids(pool.get_new_blocks(2)) == [3, 4]  # fresh before the freed block 1
    assert pool.num_free_blocks == 2_000_000 - 4
    small = BlockPool(3)
    taken = small.get_new_blocks(3)
    small.free_blocks([taken[2], taken[0]])
    assert list(small.free_block_ids()) == [2, 0] and ids(small.get_new_blocks(2)) == [2, 0]

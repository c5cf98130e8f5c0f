"""The runner's persistent block tables: deltas write only their ids, a table sent from 0 is
rewritten, rows live until released and the array grows, and the rows always equal the lists
the deltas describe."""

import random

import pytest

from pagedllm.worker.block_table import BlockTable


def row_ids(bt: BlockTable, row: int, n: int) -> list[int]:
    return bt.tensor[row, :n].tolist()


def test_deltas_write_their_ids_and_a_table_from_0_is_rewritten():
    bt = BlockTable(max_blocks_per_seq=4, num_rows=2)
    r = bt.apply(7, 0, [3, 5])
    assert row_ids(bt, r, 2) == [3, 5] and bt.num_blocks(r) == 2
    assert bt.apply(7, 2, [9]) == r and row_ids(bt, r, 4) == [3, 5, 9, 0]
    assert bt.apply(7, 3, []) == r and bt.ids(7) == [3, 5, 9]  # nothing new
    bt.apply(7, 1, [6, 9])  # copy-on-write replaced block 1
    assert row_ids(bt, r, 4) == [3, 6, 9, 0]
    bt.apply(7, 0, [1])  # a shorter table from 0: the tail is zeroed
    assert row_ids(bt, r, 4) == [1, 0, 0, 0] and bt.ids(7) == [1]
    bt.apply(7, 1, list(range(9)))  # wider than the array: it widens
    assert bt.max_blocks_per_seq >= 10 and bt.ids(7) == [1] + list(range(9))


def test_rows_live_until_released_and_the_array_grows():
    bt = BlockTable(max_blocks_per_seq=2, num_rows=2)
    a, b, c = bt.apply(1, 0, [1]), bt.apply(2, 0, [2]), bt.apply(3, 0, [3])
    assert len({a, b, c}) == 3 and bt.num_rows == 4 and bt.num_live == 3
    bt.release(2)
    assert bt.ids(2) == [] and bt.num_live == 2
    d = bt.apply(4, 0, [4])  # takes the freed row, zeroed
    assert d == b and bt.ids(4) == [4] and row_ids(bt, d, 2) == [4, 0]
    assert bt.ids(1) == [1] and bt.ids(3) == [3]  # the others kept theirs
    bt.release(99)  # unknown: nothing


def test_a_delta_for_a_table_the_runner_does_not_hold_is_refused():
    bt = BlockTable(max_blocks_per_seq=2)
    with pytest.raises(ValueError, match="does not hold"):
        bt.apply(5, 2, [7])
    bt.apply(5, 0, [1])
    with pytest.raises(ValueError, match="holds 1 ids"):
        bt.apply(5, 3, [7])


def test_random_deltas_match_the_lists():
    rng = random.Random(0)
    bt = BlockTable(max_blocks_per_seq=3, num_rows=1)
    tables: dict[int, list[int]] = {}
    for _ in range(400):
        seq_id = rng.randrange(12)
        t = tables.get(seq_id)
        op = rng.random()
        if t is None or op < 0.1:
            tables[seq_id] = [rng.randrange(1000) for _ in range(rng.randint(0, 5))]
            bt.apply(seq_id, 0, tables[seq_id])
        elif op < 0.2:
            bt.release(seq_id)
            del tables[seq_id]
        else:
            start = rng.randint(0, len(t))
            tail = [rng.randrange(1000) for _ in range(rng.randint(0, 2))]
            tables[seq_id] = t[:start] + tail
            bt.apply(seq_id, start, tail)
        for sid, ids in tables.items():
            assert bt.ids(sid) == ids
        assert bt.num_live == len(tables)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        BlockTable(0)

"""The runner's persistent block tables: only new ids are written, changed tables are rewritten,
idle rows are reused, and the rows always equal the scheduler's lists."""

import random

import pytest

from pagedllm.worker.block_table import BlockTable


def row_ids(bt: BlockTable, row: int, n: int) -> list[int]:
    return bt.tensor[row, :n].tolist()


def test_append_only_writes_new_ids_and_rewrites_a_changed_table():
    bt = BlockTable(max_blocks_per_seq=4, num_rows=2)
    bt.begin_step()
    r = bt.update(7, [3, 5])
    assert row_ids(bt, r, 2) == [3, 5]
    bt.begin_step()
    assert bt.update(7, [3, 5, 9]) == r and row_ids(bt, r, 4) == [3, 5, 9, 0]
    bt.begin_step()
    bt.update(7, [3, 6, 9])  # copy-on-write replaced a block
    assert row_ids(bt, r, 4) == [3, 6, 9, 0]
    bt.begin_step()
    bt.update(7, [1])  # recomputed after preemption: a shorter, new table; the tail is zeroed
    assert row_ids(bt, r, 4) == [1, 0, 0, 0]
    bt.begin_step()
    bt.update(7, list(range(10)))  # wider than the array: it widens
    assert bt.max_blocks_per_seq >= 10 and row_ids(bt, r, 10) == list(range(10))


def test_rows_of_idle_sequences_are_reused_and_busy_ones_grow_the_array():
    bt = BlockTable(max_blocks_per_seq=2, num_rows=2)
    bt.begin_step()
    a, b = bt.update(1, [1]), bt.update(2, [2])
    c = bt.update(3, [3])  # all rows busy in this step: the array grows
    assert len({a, b, c}) == 3 and bt.num_rows == 4
    bt.begin_step()
    rows = [bt.update(s, [s]) for s in (4, 5, 6)]  # 1 free row, then the idle rows of 1-3
    assert len(set(rows)) == 3 and bt.num_rows == 4
    assert [row_ids(bt, r, 1)[0] for r in rows] == [4, 5, 6]
    bt.begin_step()
    r1 = bt.update(1, [8, 9])  # seq 1 lost its row: written again in full
    assert row_ids(bt, r1, 2) == [8, 9]


def test_random_tables_match_the_lists():
    rng = random.Random(0)
    bt = BlockTable(max_blocks_per_seq=3, num_rows=1)
    tables: dict[int, list[int]] = {}
    for _ in range(300):
        bt.begin_step()
        seen = {}
        for seq_id in rng.sample(range(12), rng.randint(1, 8)):
            t = tables.setdefault(seq_id, [])
            op = rng.random()
            if op < 0.6:
                t.extend(rng.randrange(1000) for _ in range(rng.randint(0, 2)))
            elif op < 0.75 and t:
                t[rng.randrange(len(t))] = rng.randrange(1000)
            elif op < 0.85:
                tables[seq_id] = t = [rng.randrange(1000) for _ in range(rng.randint(0, 5))]
            seen[seq_id] = bt.update(seq_id, t)
        assert len(set(seen.values())) == len(seen)
        for seq_id, row in seen.items():
            assert row_ids(bt, row, len(tables[seq_id])) == tables[seq_id]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        BlockTable(0)

"""Tensor parallelism's building blocks (pagedllm/distributed): the sharding rules, and a
column-parallel gate/up + row-parallel down MLP and a vocab-parallel head over 2 and 3 gloo
ranks (real processes, torch.distributed) equal to the dense computation."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from pagedllm.distributed.sharding import head_shard, shard_columns, shard_range, shard_rows


def test_shard_range_and_errors():
    assert [shard_range(12, r, 3) for r in range(3)] == [(0, 4), (4, 4), (8, 4)]
    with pytest.raises(ValueError, match="576 does not divide into 5"):
        shard_range(576, 0, 5, "the hidden size")
    with pytest.raises(ValueError, match="rank 3 is not in a tensor-parallel group of 3"):
        shard_range(12, 3, 3)


def test_heads_split_or_replicated():
    # SmolLM2: 9 heads, 3 KV heads, N = 3: three query heads and one KV head each
    assert [head_shard(9, 3, r, 3) for r in range(3)] == [((0, 3), (0, 1)), ((3, 3), (1, 1)), ((6, 3), (2, 1))]
    # 8 heads, 2 KV heads, N = 4: each KV head replicated on two ranks, read by its own q heads
    shards = [head_shard(8, 2, r, 4) for r in range(4)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    for s in shards:  # q heads h read KV head h // (8 // 2): the rank holds it
        first, count = s.q_heads
        assert {h // 4 for h in range(first, first + count)} == {s.kv_heads[0]}
    with pytest.raises(ValueError, match="attention heads of 9 does not divide into 2"):
        head_shard(9, 3, 0, 2)
    with pytest.raises(ValueError, match="4 KV heads cannot be replicated evenly over 6"):
        head_shard(12, 4, 0, 6)


def test_column_and_row_shards_reassemble():
    w = torch.arange(24.0).view(4, 6)
    assert torch.equal(torch.cat([shard_columns(w, r, 2) for r in range(2)], 0), w)
    assert torch.equal(torch.cat([shard_rows(w, r, 3) for r in range(3)], 1), w)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    from pagedllm.distributed import parallel_state as ps

    ps.init_tensor_parallel(rank, world, f"tcp://127.0.0.1:{port}", backend="gloo")
    g = torch.Generator().manual_seed(0)  # every rank builds the same dense weights
    hidden, inter, vocab = 12, 30, 18
    x = torch.randn(5, hidden, generator=g)
    gate, up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
    down, head = torch.randn(hidden, inter, generator=g), torch.randn(vocab, hidden, generator=g)
    # column-parallel gate/up (each rank its slice of both), row-parallel down + all-reduce
    a = torch.nn.functional.silu(x @ shard_columns(gate, rank, world).T) * (x @ shard_columns(up, rank, world).T)
    y = ps.all_reduce_sum(a @ shard_rows(down, rank, world).T)
    logits = ps.all_gather_last(y @ shard_columns(head, rank, world).T)  # vocab-parallel head
    dense = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.save({"y": y, "logits": logits, "dense_y": dense, "dense_logits": dense @ head.T},
               os.path.join(out_dir, f"rank{rank}.pt"))
    ps.destroy_tensor_parallel()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow  # seconds (a subprocess / a compile): not in the quick `not slow` run
def test_parallel_mlp_and_head_equal_dense(tmp_path, world):
    mp.start_processes(_rank_main, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    for rank in range(world):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(r["y"], r["dense_y"], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(r["logits"], r["dense_logits"], rtol=1e-5, atol=1e-3)


def test_a_group_of_one_needs_no_distributed():
    from pagedllm.distributed import parallel_state as ps

    assert ps.tp_group().world_size == 1
    t = torch.ones(3)
    assert ps.all_reduce_sum(t) is t and ps.all_gather_last(t) is t

"""Which part of a layer each tensor-parallel rank owns.

Column-parallel layers (q/k/v, gate/up) split their output features, row-parallel layers (o,
down) their input features, followed by one all-reduce; attention splits by heads, so q heads
are divided evenly and KV heads too when there are at least as many as ranks, else each KV head
is replicated on `world // num_kv_heads` ranks (vLLM's rule). A split that does not divide is a
ValueError at start-up, never a mid-run failure.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def shard_range(size: int, rank: int, world: int, what: str = "dimension") -> tuple[int, int]:
    """(start, length) of rank `rank`'s equal part of `size`."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a tensor-parallel group of {world}")
    if size % world:
        raise ValueError(f"{what} of {size} does not divide into {world} tensor-parallel ranks")
    part = size // world
    return rank * part, part


class HeadShard(NamedTuple):
    q_heads: tuple[int, int]  # (first, count) of this rank's query heads
    kv_heads: tuple[int, int]  # (first, count) of this rank's KV heads (count 1 when replicated)


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadShard:
    """This rank's query and KV heads. Every rank's query heads must read KV heads it holds."""
    q = shard_range(num_heads, rank, world, "the number of attention heads")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads")
    if num_kv_heads >= world:
        return HeadShard(q, shard_range(num_kv_heads, rank, world, "the number of KV heads"))
    if world % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {world} ranks")
    return HeadShard(q, (rank * num_kv_heads // world, 1))


def shard_columns(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """A column-parallel layer's rows of `weight [out, in]` (output features split)."""
    start, length = shard_range(weight.shape[0], rank, world, "the output features")
    return weight.narrow(0, start, length)


def shard_rows(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """A row-parallel layer's columns of `weight [out, in]` (input features split)."""
    start, length = shard_range(weight.shape[1], rank, world, "the input features")
    return weight.narrow(1, start, length)


def vocab_shard(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """(start, length) of rank `rank`'s rows of a vocab-parallel embedding / LM head.

    Every rank but the last holds `ceil(vocab / world)` rows, so that any vocabulary splits (a
    real one rarely divides by 3); the gathered logits are padded to that size per rank and
    trimmed back (`parallel_state.gather_logits`)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a tensor-parallel group of {world}")
    per = -(-vocab_size // world)
    start = min(rank * per, vocab_size)
    return start, max(0, min(per, vocab_size - start))


class LinearShard(NamedTuple):
    """What one rank holds of a (fused) linear layer, in the checkpoint's logical `[out, in]`.

    `kind` "column": for each checkpoint projection the layer fuses (q/k/v, gate/up, or one),
    the (start, length) of its output features this rank keeps (`out_ranges`); every input.
    `kind` "row": the (start, length) of the input features (`in_range`); every output, and the
    partial products are summed over the ranks (one all-reduce) before the bias is added."""

    kind: str
    out_ranges: tuple[tuple[int, int], ...] = ()
    in_range: tuple[int, int] = (0, 0)
    full_input: int = 0  # the unsharded layer's input features
    full_outputs: tuple[int, ...] = ()  # the unsharded projections' output features


def column_shard(full_outputs: list[int], ranges: list[tuple[int, int]], full_input: int) -> LinearShard:
    return LinearShard("column", tuple(ranges), (0, full_input), full_input, tuple(full_outputs))


def row_shard(full_input: int, output: int, rank: int, world: int, what: str) -> LinearShard:
    start, length = shard_range(full_input, rank, world, what)
    return LinearShard("row", ((0, output),), (start, length), full_input, (output,))

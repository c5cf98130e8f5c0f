"""The tensor-parallel group: torch.distributed (gloo on CPU, NCCL on GPU), one per process.

`init_tensor_parallel` joins the group (every rank calls it with the same `init_method`, e.g.
`tcp://127.0.0.1:PORT` or `file:///tmp/...`); the collectives are the two a tensor-parallel
transformer needs: the sum of row-parallel partial outputs, and the gather of vocab-parallel
logits. With a group of one they are the identity and need no torch.distributed at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    backend: str


_GROUP: TensorParallelGroup | None = None


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str | None = None,
                         timeout_s: float = 120.0) -> TensorParallelGroup:
    """Join the group as `rank` of `world_size` (once per process)."""
    global _GROUP
    if _GROUP is not None:
        raise RuntimeError(f"this process is already rank {_GROUP.rank} of a tensor-parallel group")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a tensor-parallel group of {world_size}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if world_size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    _GROUP = TensorParallelGroup(rank, world_size, backend)
    return _GROUP


def tp_group() -> TensorParallelGroup:
    """This process's group (a group of one when none was initialised)."""
    return _GROUP if _GROUP is not None else TensorParallelGroup(0, 1, "none")


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the ranks, in place (the row-parallel layers' partial outputs)."""
    if tp_group().world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_last(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `t` along the last dimension (vocab-parallel logits)."""
    world = tp_group().world_size
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=-1)


def gather_logits(local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """The vocab-parallel LM head's logits on rank 0: each rank's `[rows, vocab part]`, padded
    to the common part size (sharding.vocab_shard), gathered to rank 0 (only it samples) and
    trimmed to `vocab_size`; None on the other ranks."""
    group = tp_group()
    if group.world_size == 1:
        return local
    per = -(-vocab_size // group.world_size)
    if local.shape[-1] != per:
        local = torch.nn.functional.pad(local, (0, per - local.shape[-1]))
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(group.world_size)] if group.rank == 0 else None
    dist.gather(local, parts, dst=0)
    if parts is None:
        return None
    return torch.cat(parts, dim=-1)[..., :vocab_size]


def destroy_tensor_parallel() -> None:
    global _GROUP
    if _GROUP is not None and _GROUP.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = None

"""Cores and threads of tensor-parallel ranks on one machine.

N ranks that each use every core fight over them (oversubscribed OpenMP pools spin against each
other), so each rank gets its own `cores // N` cores (at least one) and as many intra-op threads,
and every thread of its process is bound to those cores. With more ranks than cores, ranks
share cores round-robin, one thread each. The engine-core process is rank 0: its binding is
undone (`restore`) when the executor shuts down. Data-parallel replicas on CPU split the
machine the same way first (engine/core_process.py); their tensor-parallel ranks then split
the replica's share.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)


class CpuBinding(NamedTuple):
    cores: tuple[int, ...]
    num_threads: int


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def rank_binding(rank: int, world: int, cores: list[int], num_threads: int | None = None) -> CpuBinding:
    """Rank `rank`'s share of `cores`: a contiguous slice of `len(cores) // world` cores, or one
    core (round-robin) when there are fewer cores than ranks. `num_threads` (the user's knob, per
    rank) overrides the thread count, not the cores."""
    if not cores:
        raise ValueError("no CPU cores available")
    per = max(1, len(cores) // world)
    if len(cores) >= world:
        mine = tuple(cores[rank * per:(rank + 1) * per])
    else:
        mine = (cores[rank % len(cores)],)
    return CpuBinding(mine, num_threads or len(mine))


def _set_all_threads_affinity(cores: set[int]) -> None:
    """Bind every existing thread of this process (OpenMP's pool included) and, through
    inheritance, the threads it starts later."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except (OSError, AttributeError):
            pass  # a thread that just ended, or no affinity API: the thread count still applies


def apply(binding: CpuBinding, rank: int, role: str = "tensor-parallel rank") -> CpuBinding:
    """Bind this process to `binding`; returns the previous state (for `restore`). `role`
    names what `rank` counts in the log line (a data-parallel replica binds this way too)."""
    previous = CpuBinding(tuple(available_cores()), torch.get_num_threads())
    _set_all_threads_affinity(set(binding.cores))
    torch.set_num_threads(binding.num_threads)
    logger.info("%s %d: %d threads on cores %s", role, rank, binding.num_threads,
                ",".join(map(str, binding.cores)))
    return previous


def restore(previous: CpuBinding) -> None:
    _set_all_threads_affinity(set(previous.cores))
    torch.set_num_threads(previous.num_threads)

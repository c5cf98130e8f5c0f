"""Tensor-parallel ranks 1..N-1 as Ray actors (`distributed_executor_backend="ray"`).

Ray only places and starts the workers; everything after is the multiprocess executor's
(executor/multiproc.py): each actor connects back to rank 0's link over TCP, receives its
WorkerConfig, joins the torch.distributed group at the address Ray reports for rank 0's node,
loads its shard and runs the same step loop (executor/worker_proc.run_worker).

- The engine joins the Ray cluster it finds: `RAY_ADDRESS` (or `ray start --head` /
  `ray start --address` on this machine: address "auto" when a local cluster runs), or an
  already initialised `ray.init(...)` in the process; with neither, Ray starts a local one.
- A placement group reserves one bundle per rank (`{"CPU": c}` on CPU, `{"GPU": 1, "CPU": c}`
  on CUDA; `c` = PAGEDLLM_RAY_CPUS_PER_RANK, default 1), `STRICT_PACK` by default (every rank on
  one node: the collectives stay off the network), `PAGEDLLM_RAY_PLACEMENT_STRATEGY=PACK` or
  `SPREAD` to span nodes. Bundle 0 is rank 0's (the engine process itself, which must run on a
  node of the cluster); ranks 1..N-1 are actors in bundles 1..N-1.
- Actors set their thread count to their bundle's CPUs; Ray owns their placement (no core
  binding here). They die with their owner (the engine), with the placement group removed at
  shutdown, and when their link closes.
"""

from __future__ import annotations

import os
import subprocess
import traceback
import weakref
from typing import Any

import torch

from pagedllm import envs
from pagedllm.executor.channel import connect
from pagedllm.executor.multiproc import MultiprocExecutor, _Proc
from pagedllm.executor.worker_proc import run_worker
from pagedllm.worker.worker import WorkerConfig

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
PLACEMENT_WAIT_S = 120.0  # how long the cluster may take to reserve the bundles


def _placement() -> tuple[float, str]:
    """(CPUs per rank, placement strategy), read when an executor starts."""
    return envs.PAGEDLLM_RAY_CPUS_PER_RANK, envs.PAGEDLLM_RAY_PLACEMENT_STRATEGY


def _import_ray():
    try:
        import ray  # lazy: ray is optional (pagedllm[ray])
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]'") from None
    return ray


class _WorkerActor:
    """The body of a Ray actor: one rank, until rank 0 says stop or its link closes."""

    def __init__(self, num_threads: int) -> None:
        torch.set_num_threads(max(1, num_threads))

    def node_ip(self) -> str:
        import ray  # lazy: ray is optional (pagedllm[ray])

        return ray.util.get_node_ip_address()

    def run(self, address: tuple[str, int], authkey: bytes, rank: int) -> None:
        """executor/worker_proc.main's loop, in this actor: connect, stages, steps."""
        conn = connect(address, authkey)
        try:
            conn.send(("hello", rank, os.getpid()))
            _, config, init_method, binding = conn.recv()
            run_worker(conn, rank, config, init_method, binding)
        except (EOFError, ConnectionError):
            return  # rank 0 is gone
        except BaseException:
            try:
                conn.send(("error", rank, traceback.format_exc()))
            except OSError:
                pass
            os._exit(1)  # as a worker process does: its sockets close, the peers' collectives fail now


class _ActorHandle:
    """A Ray actor as `_Proc` sees a process: poll / wait / terminate / kill, and how it ended."""

    def __init__(self, ray, actor, ref) -> None:
        self._ray, self.actor, self.ref = ray, actor, ref
        self.pid = None  # from its hello
        self._ended: str | None = None

    def poll(self) -> int | None:
        if self._ended is not None:
            return 1
        ready, _ = self._ray.wait([self.ref], timeout=0)
        if not ready:
            return None
        try:
            self._ray.get(self.ref)
            self._ended = "its Ray actor returned"
        except Exception as e:  # RayActorError (the actor process died), RayTaskError (it raised)
            self._ended = f"its Ray actor ended: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return 1

    def exit_text(self) -> str:
        return self._ended or "running"

    def wait(self, timeout: float | None = None) -> int:
        ready, _ = self._ray.wait([self.ref], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired("ray actor", timeout)
        return self.poll()

    def terminate(self) -> None:
        self._ray.kill(self.actor, no_restart=True)

    kill = terminate


class RayExecutor(MultiprocExecutor):
    def __init__(self, config: WorkerConfig) -> None:
        ray = _import_ray()
        if not ray.is_initialized():
            address = envs.RAY_ADDRESS or None
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=True)
        self._ray = ray
        self._pg = None
        super().__init__(config)

    def _check_devices(self, config: WorkerConfig) -> None:
        """The GPUs are the cluster's: a placement group that cannot get them is the error."""

    def _host(self) -> str:
        return self._ray.util.get_node_ip_address()

    def _bindings(self, config: WorkerConfig) -> list[Any]:
        return [None] * self.world_size  # Ray places the actors; threads come from the bundles

    def _launch(self, config: WorkerConfig) -> None:
        ray = self._ray
        # lazy: ray is optional (pagedllm[ray])
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cpus, strategy = _placement()
        bundle: dict[str, float] = {"CPU": cpus}
        if config.device_type == "cuda":
            bundle["GPU"] = 1
        # bundle 0 is rank 0's, on this (the engine's) node; ranks 1..N-1 where the strategy puts them
        here = {f"node:{self._host()}": 0.001}
        bundles = [dict(bundle, **here)] + [dict(bundle) for _ in range(1, self.world_size)]
        self._pg = placement_group(bundles, strategy=strategy)
        weakref.finalize(self, _remove_placement_group, self._pg)  # also when collected, or at exit
        ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_WAIT_S)
        if not ready:
            available = ray.available_resources()
            raise ValueError(f"tensor_parallel_size={self.world_size}: the Ray cluster cannot place "
                             f"{self.world_size} bundles of {bundle} ({strategy}) within {PLACEMENT_WAIT_S:.0f} s; "
                             f"available resources: {available}")
        actor_cls = ray.remote(num_cpus=cpus, num_gpus=bundle.get("GPU", 0))(_WorkerActor)
        host, port = self._listener.address
        for rank in range(1, self.world_size):
            in_bundle = PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=rank)
            actor = actor_cls.options(scheduling_strategy=in_bundle).remote(int(cpus))
            ref = actor.run.remote((host, port), self._listener.authkey, rank)
            self._procs.append(_Proc(rank, _ActorHandle(ray, actor, ref)))

    def shutdown(self) -> None:
        super().shutdown()
        if self._pg is not None:
            _remove_placement_group(self._pg)
            self._pg = None


def _remove_placement_group(pg) -> None:
    try:
        # lazy: ray is optional (pagedllm[ray])
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
    except Exception:  # removed already, or the cluster is gone
        pass

"""`RayCoreClient` (`--distributed-executor-backend ray` with `--data-parallel-size M`): the
core process is a Ray actor placed in a bundle of the replicas' placement group (`RayReplicas`),
on any node of the cluster; the same protocol as `MPCoreClient` over TCP sockets this process
binds on its node's address; the actor's end (its `run` call fails) is the death signal."""

from __future__ import annotations

import logging
from typing import Any

from pagedllm import envs
from pagedllm.engine.core_client import MPCoreClient, OnDeath
from pagedllm.engine.core_process import CoreAddresses, run_engine_core

class _CoreActor:
    """The body of a Ray actor that is one engine core (a data-parallel replica)."""

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def run(self, config: Any, engine_index: int, addresses: CoreAddresses, log_level: int) -> None:
        run_engine_core(config, engine_index, addresses, parent_pid=None, log_level=log_level,
                        handle_signals=False)


class RayReplicas:
    """The placement group of the data-parallel replicas: one bundle per replica
    (`PAGEDLLM_RAY_CPUS_PER_REPLICA` CPUs, default 1, and a GPU on CUDA), PACK by default
    (`PAGEDLLM_RAY_REPLICA_STRATEGY`: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)."""

    def __init__(self, num_replicas: int, device_type: str, wait_s: float = 120.0) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("distributed_executor_backend='ray' needs Ray: "
                             "pip install 'pagedllm[ray]'") from None
        from ray.util.placement_group import placement_group

        if not ray.is_initialized():
            ray.init(address=envs.RAY_ADDRESS or None, ignore_reinit_error=True)
        self.ray = ray
        cpus = envs.PAGEDLLM_RAY_CPUS_PER_REPLICA
        strategy = envs.PAGEDLLM_RAY_REPLICA_STRATEGY
        self.bundle: dict[str, float] = {"CPU": cpus}
        if device_type == "cuda":
            self.bundle["GPU"] = 1
        self.group = placement_group([dict(self.bundle) for _ in range(num_replicas)],
                                     strategy=strategy)
        ready, _ = ray.wait([self.group.ready()], timeout=wait_s)
        if not ready:
            self.remove()
            raise ValueError(f"data_parallel_size={num_replicas}: the Ray cluster cannot place "
                             f"{num_replicas} bundles of {self.bundle} ({strategy}) within "
                             f"{wait_s:.0f} s; available: {ray.available_resources()}")

    def remove(self) -> None:
        try:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
        except Exception:  # removed already, or the cluster is gone
            pass


class RayCoreClient(MPCoreClient):
    """An engine core as a Ray actor in bundle `engine_index` of `replicas`, over TCP."""

    def __init__(self, config: Any, engine_index: int, replicas: RayReplicas,
                 startup_timeout: float = 1800.0) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = replicas.ray
        self.engine_index = engine_index
        self._own_dir = False
        self._ray = ray
        # CURVE-authenticated and encrypted (engine/core_channel.py), like the ipc sockets
        host = getattr(config, "data_parallel_address", None) or ray.util.get_node_ip_address()
        ready_sock = self._bind_sockets(f"tcp://{host}:0", f"tcp://{host}:0", f"tcp://{host}:0")
        strategy = PlacementGroupSchedulingStrategy(placement_group=replicas.group,
                                                    placement_group_bundle_index=engine_index)
        actor_cls = ray.remote(num_cpus=replicas.bundle["CPU"],
                               num_gpus=replicas.bundle.get("GPU", 0))(_CoreActor)
        self.actor = actor_cls.options(scheduling_strategy=strategy,
                                       name=None).remote()
        self._run_ref = None
        self._ended: str | None = None

        def launch() -> None:
            self._run_ref = self.actor.run.remote(config, engine_index, self.addresses,
                                                  logging.getLogger().getEffectiveLevel())

        self._start(ready_sock, launch, startup_timeout)

    def _process_exitcode(self):
        if self._ended is not None:
            return self._ended
        if self._run_ref is None:
            return None
        ready, _ = self._ray.wait([self._run_ref], timeout=0)
        if not ready:
            return None
        try:
            self._ray.get(self._run_ref)
            self._ended = "its Ray actor returned"
        except Exception as exc:  # RayActorError: the actor's process died
            first = str(exc).splitlines()[0] if str(exc) else ""
            self._ended = f"its Ray actor ended: {type(exc).__name__}: {first}"
        return self._ended

    def _watch_process(self, on_death: OnDeath) -> None:
        while self._process_exitcode() is None:
            self._ray.wait([self._run_ref], timeout=1.0)
        self._report_end(on_death, f"Engine core {self.engine_index} (Ray actor)", self._ended)

    def _join(self, timeout: float) -> None:
        if self._run_ref is not None:
            self._ray.wait([self._run_ref], timeout=timeout)

    def _kill(self) -> None:
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:
            pass

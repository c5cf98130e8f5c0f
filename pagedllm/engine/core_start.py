"""Engine cores starting in the background while the front end gets ready.

A core process spends seconds importing torch and loading its model; the API process spends
seconds importing the HTTP stack, torch and transformers and loading the tokenizer. On a
2-core machine the two overlap only if the cores are launched first: `pagedllm serve` makes a
`CoreStart` before its heavy imports (entrypoints/cli.py), and `AsyncLLMEngine` loads the
tokenizer before it waits for the cores' hand-shakes. This module imports nothing heavy.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any

from pagedllm import envs

# Set to 1: the server's engine core runs in its own process's thread (tests, debugging).
IN_PROCESS_ENV = "PAGEDLLM_ENGINE_IN_PROCESS"


def in_process_requested() -> bool:
    return envs.PAGEDLLM_ENGINE_IN_PROCESS


class CoreStart:
    """The engine cores of `config`, launched now; `clients()` waits for them to be ready.

    Hub ids are resolved (downloaded) here, once, and the cores get the commits they resolved
    to. `in_process` builds one core in this process when `clients()` is called (tests)."""

    def __init__(self, config: Any, in_process: bool = False) -> None:
        from pagedllm.model_source import pin_revisions, resolve_model_source, resolve_tokenizer_source

        self.source = resolve_model_source(config)
        self.tok_source = resolve_tokenizer_source(config, self.source)
        self.config = pin_revisions(config, self.source, self.tok_source)
        self.in_process = in_process
        self.ray_replicas: Any = None
        self._futures: list[concurrent.futures.Future] = []
        self._clients: list[Any] | None = None
        replicas = getattr(self.config, "data_parallel_size", 1)
        if in_process:
            return
        from pagedllm.engine.core_client import MPCoreClient

        make: Any = MPCoreClient
        if self.config.distributed_executor_backend == "ray" and replicas > 1:
            from pagedllm.engine.core_client_ray import RayCoreClient, RayReplicas
            from pagedllm.worker.device import resolve_device

            self.ray_replicas = RayReplicas(replicas, resolve_device(self.config.device).type)
            make = functools.partial(RayCoreClient, replicas=self.ray_replicas)
        pool = concurrent.futures.ThreadPoolExecutor(max(replicas, 1),
                                                     thread_name_prefix="pagedllm-core-start")
        self._futures = [pool.submit(make, self.config, i) for i in range(replicas)]
        pool.shutdown(wait=False)

    def clients(self) -> list[Any]:
        """The ready core clients, in engine-index order. A core that failed to start raises
        its error here, once the others are shut down."""
        if self._clients is not None:
            return self._clients
        if self.in_process:
            from pagedllm.engine.core import EngineCore
            from pagedllm.engine.core_client import InprocCoreClient

            self._clients = [InprocCoreClient(EngineCore(self.config))]
            return self._clients
        clients = []
        for f in self._futures:
            try:
                clients.append(f.result())
            except BaseException:
                self.abandon()
                raise
        self._clients = clients
        return clients

    def abandon(self) -> None:
        """Shut down every core that started (waiting for those still starting)."""
        for f in self._futures:
            try:
                client = f.result()
            except BaseException:
                continue
            client.shutdown(5)
        self._futures = []
        if self.ray_replicas is not None:
            self.ray_replicas.remove()
            self.ray_replicas = None

"""AsyncPoolingEngine: the server's handle on the pooling engine, which runs in its own process
(core_process.py). Requests are validated and tokenized on the event loop
(`PoolingInputs.prepare_many`, no model), sent to the core, and each finished one resolves its
future on the event loop. A request's failure is its own (400); a core that dies fails the
requests in flight (503), turns /health to 503 and calls `on_fatal` (the server exits 1)."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable

import torch

from pagedllm.config import EngineConfig
from pagedllm.pooling.core_process import PoolingCoreClient
from pagedllm.pooling.inputs import PoolingInputs
from pagedllm.pooling.outputs import PoolingOutput, PoolingRequestOutput
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.work import PoolingWork

logger = logging.getLogger("pagedllm.pooling")


class PoolingEngineDeadError(RuntimeError):
    pass


class AsyncPoolingEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.inputs = PoolingInputs(config)
        self._futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future, list[int]]] = {}
        self._lock = threading.Lock()  # guards _futures between the event loop and the reader
        self.dead: str | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self.core = PoolingCoreClient(config, self._on_message, self._on_exit)

    def start(self) -> None:
        pass  # the core process runs from construction on

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.core.shutdown)

    def health_problem(self) -> str | None:
        return self.dead

    # ---- requests -------------------------------------------------------------------------

    async def submit(self, params: PoolingParams, work: PoolingWork) -> PoolingRequestOutput:
        """Run one prepared request to its output; cancelled (client gone): aborted."""
        if self.dead is not None:
            raise PoolingEngineDeadError(self.dead)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if work.request_id in self._futures:
                raise ValueError(f"Request id {work.request_id!r} is already in use.")
            self._futures[work.request_id] = (loop, fut, work.token_ids)
        self.core.send(("add", params, work))
        try:
            return await fut
        except asyncio.CancelledError:
            if self.dead is None:
                self.core.send(("abort", work.request_id))
            raise
        finally:
            with self._lock:
                self._futures.pop(work.request_id, None)

    # ---- the reader thread ----------------------------------------------------------------

    def _settle(self, rid: str, result: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            entry = self._futures.get(rid)
        if entry is None:
            return
        loop, fut, _ = entry

        def settle() -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(result)

        loop.call_soon_threadsafe(settle)

    def _on_message(self, msg: tuple) -> None:
        if msg[0] == "outputs":
            for rid, data, _ in msg[1]:
                with self._lock:
                    entry = self._futures.get(rid)
                if entry is not None:
                    self._settle(rid, PoolingRequestOutput(rid, PoolingOutput(torch.from_numpy(data)), entry[2]))
        elif msg[0] == "error":
            self._settle(msg[1], error=ValueError(msg[2]))

    def _on_exit(self, reason: str) -> None:
        self.dead = reason
        logger.error("%s", reason)
        with self._lock:
            rids = list(self._futures)
        for rid in rids:
            self._settle(rid, error=PoolingEngineDeadError(reason))
        if self.on_fatal is not None:
            self.on_fatal(reason)

"""AsyncPoolingEngine: the server's handle on a `PoolingEngine`. Requests are validated and
tokenized on the event loop (`PoolingEngine.prepare`, no engine state), then handed to one
loop thread that owns the engine: it drains its inbox (adds, aborts), runs a step, and
resolves each finished request's future on the event loop. A request's failure is its own;
a failed step fails the requests in flight and marks the engine unhealthy (503)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any

from pagedllm.pooling.engine import PoolingEngine
from pagedllm.pooling.outputs import PoolingRequestOutput
from pagedllm.pooling.params import PoolingParams

logger = logging.getLogger("pagedllm.pooling")


class PoolingEngineDeadError(RuntimeError):
    pass


class AsyncPoolingEngine:
    def __init__(self, engine: PoolingEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._lock = threading.Lock()  # guards _futures between the two threads
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.dead: str | None = None

    # ---- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pagedllm-pooling", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    def health_problem(self) -> str | None:
        if self.dead is not None:
            return self.dead
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            return "The pooling engine thread is gone."
        return None

    # ---- requests -------------------------------------------------------------------------

    async def encode(self, request_id: str, prompt: Any, params: PoolingParams,
                     pair: str | None = None) -> PoolingRequestOutput:
        """Run one pooling request to its output; cancelled (client gone): aborted."""
        params, work = self.engine.prepare(request_id, prompt, params, pair)
        return await self.submit(params, work)

    async def submit(self, params: PoolingParams, work) -> PoolingRequestOutput:
        if self.dead is not None:
            raise PoolingEngineDeadError(self.dead)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if work.request_id in self._futures:
                raise ValueError(f"Request id {work.request_id!r} is already in use.")
            self._futures[work.request_id] = (loop, fut)
        self._inbox.put(("add", params, work))
        try:
            return await fut
        except asyncio.CancelledError:
            self._inbox.put(("abort", work.request_id))
            raise
        finally:
            with self._lock:
                self._futures.pop(work.request_id, None)

    # ---- the loop thread ------------------------------------------------------------------

    def _resolve(self, rid: str, result: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            entry = self._futures.get(rid)
        if entry is None:
            return
        loop, fut = entry

        def settle() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        loop.call_soon_threadsafe(settle)

    def _drain(self, block: bool) -> None:
        engine = self.engine
        while True:
            try:
                msg = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if msg is None:
                return
            if msg[0] == "add":
                _, params, work = msg
                try:
                    engine.add_prepared(params, work)
                except Exception as exc:  # that request's fault only
                    self._resolve(work.request_id, error=exc if isinstance(exc, ValueError) else RuntimeError(repr(exc)))
            elif msg[0] == "abort":
                engine.abort_request(msg[1])

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain(block=not engine.has_unfinished_requests())
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                logger.exception("pooling step failed")
                self.dead = f"The pooling engine failed: {exc!r}"
                with self._lock:
                    rids = list(self._futures)
                for rid in rids:
                    self._resolve(rid, error=PoolingEngineDeadError(self.dead))
                return
            for out in outputs:
                self._resolve(out.request_id, out)

"""AsyncLLMEngine: the LLMEngine behind an asyncio server.

One dedicated thread owns the `LLMEngine`: it is the only code that calls `add_request`,
`abort_request` and `step()`, so the engine stays single-threaded and the event loop never
runs model work. The event loop talks to that thread through a queue of operations (add /
abort) guarded by a condition variable; the thread sends each step's `RequestOutput`s back with
one `loop.call_soon_threadsafe` per step, and they are fanned out to one `RequestStream` per
request.

    stream = await engine.add_request(request_id, prompt, params)   # ValueError: rejected
    async for output in engine.generate(prompt, params, request_id):  # cumulative outputs
        ...

Leaving the `generate` iterator early (the client went away, the handler task was cancelled)
aborts the request: the engine thread drops it from the scheduler and its KV blocks go back to
the pool before the next step.

Outputs are cumulative (text, token ids, logprobs so far), so a stream whose consumer is slower
than the engine keeps only the newest one: nothing is lost, and a slow client never makes the
queue grow. `CompletionOutput.logprobs` is the engine's own list, which grows while the
consumer reads it: read it up to `len(token_ids)` of the same output.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.engine import LLMEngine, PromptType
    from pagedllm.metrics import EngineMetrics

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown, or an error it could not recover from)."""


class RequestStream:
    """The outputs of one request, on the event loop: the newest cumulative output or an
    error. Only the event loop thread touches it."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self._latest = output  # cumulative: the newest output supersedes an unread one
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    async def get(self) -> RequestOutput:
        """The next (newest) output; raises the request's error if it failed."""
        while True:
            if self._latest is None and self._error is None:
                self._event.clear()
                await self._event.wait()
            if self._latest is not None:
                out, self._latest = self._latest, None
                if out.finished:
                    self.finished = True
                return out
            if self._error is not None:
                self.finished = True
                raise self._error


class AsyncLLMEngine:
    """Runs an `LLMEngine`'s step loop in one background thread for an asyncio server."""

    def __init__(self, engine: "LLMEngine", metrics: "EngineMetrics | None" = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._cond = threading.Condition()
        self._ops: deque[tuple] = deque()  # ("add", ...) / ("abort", request_id)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # event loop thread only
        self.dead_error: BaseException | None = None

    @classmethod
    def from_engine_config(cls, config: "EngineConfig", with_metrics: bool = True):
        from pagedllm.engine.engine import LLMEngine

        engine = LLMEngine(config)
        metrics = None
        if with_metrics:
            from pagedllm.metrics import EngineMetrics

            metrics = EngineMetrics(engine.model_name)
            metrics.update_from_engine(engine)
        return cls(engine, metrics)

    # ---- life cycle (event loop) ----------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._thread_main, name="pagedllm-engine",
                                        daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step; open streams fail."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        error = EngineDeadError("The server is shutting down.")
        for stream in list(self._streams.values()):
            stream.fail(error)
        self._streams.clear()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    # ---- requests (event loop) ------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: "PromptType",
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Queue a request for the engine thread and wait until the engine accepted it.

        Raises the engine's ValueError (bad prompt, too long, ...) when it is rejected."""
        if not self.is_running:
            raise EngineDeadError("The engine is not running.") from self.dead_error
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        accepted = asyncio.get_running_loop().create_future()
        arrival = time.time() if arrival_time is None else arrival_time
        self._submit(("add", request_id, prompt, params, arrival, accepted))
        try:
            await accepted
        except BaseException:
            # Rejected, or the caller was cancelled while waiting: in the latter case the add
            # may still go through, and the abort queued behind it undoes it.
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            self._submit(("abort", request_id))
            raise
        return stream

    async def add_requests(
        self, requests: list[tuple[str, "PromptType"]], params: SamplingParams
    ) -> list[RequestStream]:
        """Add several requests at once (one engine-thread round trip for all of them). If
        any is rejected, the others are aborted and its error is raised."""
        results = await asyncio.gather(
            *(self.add_request(rid, prompt, params) for rid, prompt in requests),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in results:
                if isinstance(r, RequestStream):
                    self.abort(r.request_id)
            raise errors[0]
        return list(results)

    async def stream_outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Yield a request's cumulative outputs until the finished one. Leaving early (close,
        cancel, an error while consuming) aborts the request."""
        try:
            while True:
                out = await stream.get()
                yield out
                if out.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    async def generate(
        self,
        prompt: "PromptType",
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """add_request + stream_outputs: the request's outputs until the finished one."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        async for out in self.stream_outputs(stream):
            yield out

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        """Abort every request of `streams` whose finished output was not consumed."""
        for stream in streams:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished). Call on the event loop thread."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.finished = True
        self._submit(("abort", request_id))

    def _submit(self, op: tuple) -> None:
        with self._cond:
            self._ops.append(op)
            self._cond.notify()

    # ---- delivery (event loop; scheduled by the engine thread) ----------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted on this side already
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _deliver_error(self, request_ids: list[str] | None, error: BaseException) -> None:
        ids = list(self._streams) if request_ids is None else request_ids
        for rid in ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.fail(error)

    @staticmethod
    def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _call_on_loop(self, fn, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # ---- the engine thread ----------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            self._run_loop()
        except BaseException as exc:  # never silently: every open request hears of it
            logger.exception("The engine thread died")
            self.dead_error = exc
            error = EngineDeadError(f"The engine stopped: {exc!r}")
            self._call_on_loop(self._deliver_error, None, error)
        finally:
            with self._cond:
                self._stopping = True

    def _run_loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._ops and not self._stopping and not engine.has_unfinished_requests():
                    self._cond.wait()
                if self._stopping:
                    return
                ops = list(self._ops)
                self._ops.clear()
            if ops:
                self._apply(ops)
            if engine.has_unfinished_requests():
                self._step()
            if self.metrics is not None:
                self.metrics.update_from_engine(engine)

    def _apply(self, ops: list[tuple]) -> None:
        engine = self.engine
        for op in ops:
            if op[0] == "add":
                _, rid, prompt, params, arrival, accepted = op
                error: BaseException | None = None
                try:
                    engine.add_request(rid, prompt, params, arrival_time=arrival)
                except Exception as exc:  # ValueError: the client's fault; else ours
                    error = exc
                    if not isinstance(exc, ValueError):
                        logger.exception("add_request(%s) failed", rid)
                self._call_on_loop(self._resolve, accepted, error)
            else:
                rid = op[1]
                if rid in engine.requests:
                    engine.abort_request(rid)
                    if self.metrics is not None:
                        self.metrics.record_abort(rid)

    def _step(self) -> None:
        engine = self.engine
        t0 = time.perf_counter()
        try:
            outputs = engine.step()
        except Exception as exc:
            # A bug, not a request's fault: fail the requests that were in flight, drop them
            # so that their blocks return, and go on serving the next ones.
            logger.exception("engine.step() failed; aborting the requests in flight")
            rids = list(engine.requests)
            for rid in rids:
                try:
                    engine.abort_request(rid)
                except Exception:
                    logger.exception("abort_request(%s) failed", rid)
                if self.metrics is not None:
                    self.metrics.record_abort(rid)
            self._call_on_loop(self._deliver_error, rids,
                               RuntimeError(f"The engine failed while running this request: {exc}"))
            return
        if outputs:
            if self.metrics is not None:
                self.metrics.record_step(outputs, time.time())
            self._call_on_loop(self._deliver, outputs)
        elif time.perf_counter() - t0 < 1e-3:
            time.sleep(1e-3)  # nothing could be scheduled: do not spin

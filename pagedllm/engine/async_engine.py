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

Each add gets a serial number of its own (`RequestStream.serial`); the engine thread tags every
output and error with the serial of the request that produced it, and aborts name it too. An id
that is aborted and added again while a step is in flight therefore never receives the old
request's outputs, and a late abort by the old request's consumer never hits the new one.

After `shutdown()` returns, the engine thread calls nothing on the event loop any more (a step
still running finishes on its own and is dropped); adds still waiting for the engine fail.

A `SchedulerStallError` from `step()` (the engine's watchdog: unfinished requests, no progress)
fails the named requests (a 500 for the client), aborts them so that their blocks return, and
sets `health_error`: the server's /health answers 503 from then on, until it is restarted. The
engine goes on serving new requests meanwhile (the stall is a bug to report, and the others may
well finish), so a restart by the orchestrator can drain it.

Outputs are cumulative (text, token ids, logprobs so far), so a stream whose consumer is slower
than the engine keeps only the newest one: nothing is lost, and a slow client never makes the
queue grow. `CompletionOutput.logprobs` is the engine's own list, which grows while the
consumer reads it: read it up to `len(token_ids)` of the same output.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pagedllm.engine.errors import SchedulerStallError
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

    def __init__(self, request_id: str, serial: int = -1) -> None:
        self.request_id = request_id
        self.serial = serial  # unique per add: tells apart requests that reuse an id
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
        self._pending_adds: dict[int, asyncio.Future] = {}  # serial -> accepted (event loop)
        self._serials = itertools.count()
        self._live: dict[str, int] = {}  # engine thread only: request id -> serial in the engine
        self._closed = False  # set by shutdown (under _cond): nothing reaches the loop after it
        self.dead_error: BaseException | None = None
        # Why the engine is unhealthy (a scheduler stall), or None; /health answers 503 with it.
        self.health_error: str | None = None

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
        """Stop the engine thread after its current step; open streams and adds waiting for the
        engine fail. From the moment this starts, the thread delivers nothing more; it is
        awaited up to `timeout` seconds (a longer step finishes on its own, unheard)."""
        with self._cond:
            self._stopping = True
            self._closed = True
            self._cond.notify()
        error = EngineDeadError("The server is shutting down.")
        for accepted in list(self._pending_adds.values()):
            if not accepted.done():
                accepted.set_exception(error)
        self._pending_adds.clear()
        for stream in list(self._streams.values()):
            stream.fail(error)
        self._streams.clear()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
            if self._thread.is_alive():
                logger.warning("The engine thread is still in a step after %.1f s; it stops "
                               "after that step and delivers nothing more.", timeout)

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
        stream = RequestStream(request_id, next(self._serials))
        self._streams[request_id] = stream
        accepted = asyncio.get_running_loop().create_future()
        self._pending_adds[stream.serial] = accepted
        arrival = time.time() if arrival_time is None else arrival_time
        self._submit(("add", request_id, stream.serial, prompt, params, arrival, accepted))
        try:
            await accepted
        except BaseException:
            # Rejected, or the caller was cancelled while waiting: in the latter case the add
            # may still go through, and the abort queued behind it undoes it.
            self._abort_stream(stream)
            raise
        finally:
            self._pending_adds.pop(stream.serial, None)
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
                    self._abort_stream(r)
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
                self._abort_stream(stream)

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
                self._abort_stream(stream)

    def abort(self, request_id: str) -> None:
        """Abort the request now known by `request_id` (no-op if it already finished). Call on
        the event loop thread."""
        stream = self._streams.get(request_id)
        if stream is not None:
            self._abort_stream(stream)
        else:
            self._submit(("abort", request_id, None))

    def _abort_stream(self, stream: RequestStream) -> None:
        """Abort the request of `stream` only: not a later request that reuses its id."""
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        stream.finished = True
        self._submit(("abort", stream.request_id, stream.serial))

    def _submit(self, op: tuple) -> None:
        with self._cond:
            self._ops.append(op)
            self._cond.notify()

    # ---- delivery (event loop; scheduled by the engine thread) ----------------------------

    def _deliver(self, outputs: list[tuple[int | None, RequestOutput]]) -> None:
        """(serial, output) pairs: an output reaches only the stream of the add it came from."""
        for serial, out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None or stream.serial != serial:
                continue  # aborted on this side already (maybe its id is in use again)
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _deliver_error(
        self, failures: list[tuple[str, int | None, BaseException]] | None,
        error: BaseException | None = None,
    ) -> None:
        """Fail the (request id, serial, error) streams; None: every open stream, with `error`."""
        if failures is None:
            failures = [(rid, s.serial, error) for rid, s in self._streams.items()]
        for rid, serial, exc in failures:
            stream = self._streams.get(rid)
            if stream is not None and stream.serial == serial:
                del self._streams[rid]
                stream.fail(exc)

    @staticmethod
    def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _call_on_loop(self, fn, *args: Any) -> None:
        """From the engine thread: run `fn(*args)` on the loop, unless shutdown has begun (it
        is checked here under the lock, and again on the loop, where shutdown runs)."""
        with self._cond:
            if self._closed:
                return
            try:
                self._loop.call_soon_threadsafe(self._on_loop, fn, args)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _on_loop(self, fn, args: tuple) -> None:
        if not self._closed:
            fn(*args)

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
                _, rid, serial, prompt, params, arrival, accepted = op
                error: BaseException | None = None
                try:
                    engine.add_request(rid, prompt, params, arrival_time=arrival)
                    self._live[rid] = serial
                except Exception as exc:  # ValueError: the client's fault; else ours
                    error = exc
                    if not isinstance(exc, ValueError):
                        logger.exception("add_request(%s) failed", rid)
                self._call_on_loop(self._resolve, accepted, error)
            else:
                _, rid, serial = op
                if serial is not None and self._live.get(rid) != serial:
                    continue  # that request is gone; the id may belong to a newer one
                self._live.pop(rid, None)
                self._abort_in_engine(rid)

    def _abort_in_engine(self, rid: str) -> None:
        engine = self.engine
        if rid in engine.requests:
            try:
                engine.abort_request(rid)
            except Exception:
                logger.exception("abort_request(%s) failed", rid)
            if self.metrics is not None:
                self.metrics.record_abort(rid)

    def _step(self) -> None:
        engine = self.engine
        t0 = time.perf_counter()
        try:
            outputs = engine.step()
        except SchedulerStallError as exc:
            # The watchdog: these requests make no progress. Fail and drop them (their blocks
            # return), report the engine unhealthy until restart, serve the others.
            logger.error("Scheduler stall: %s; aborting those requests, /health now 503", exc)
            self.health_error = str(exc)
            self._fail_requests(exc.request_ids, lambda rid: SchedulerStallError(
                [rid], exc.num_steps,
                "the request was aborted; the server reports itself unhealthy until restarted"))
            return
        except Exception as exc:
            # A bug, not a request's fault: fail the requests that were in flight, drop them
            # so that their blocks return, and go on serving the next ones.
            logger.exception("engine.step() failed; aborting the requests in flight")
            self._fail_requests(list(engine.requests), lambda _: RuntimeError(
                f"The engine failed while running this request: {exc}"))
            return
        if outputs:
            if self.metrics is not None:
                self.metrics.record_step(outputs, time.time())
            live = self._live
            tagged = [(live.get(out.request_id), out) for out in outputs]
            for out in outputs:
                if out.finished:
                    live.pop(out.request_id, None)
            if len(live) > len(engine.requests):  # one left without a finished output
                self._live = {rid: s for rid, s in live.items() if rid in engine.requests}
            self._call_on_loop(self._deliver, tagged)
        elif time.perf_counter() - t0 < 1e-3:
            time.sleep(1e-3)  # nothing could be scheduled: do not spin

    def _fail_requests(self, rids: list[str], make_error) -> None:
        """Abort `rids` in the engine and fail their streams with `make_error(rid)`."""
        failures = []
        for rid in rids:
            serial = self._live.pop(rid, None)
            self._abort_in_engine(rid)
            failures.append((rid, serial, make_error(rid)))
        self._call_on_loop(self._deliver_error, failures)

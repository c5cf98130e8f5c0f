"""AsyncLLMEngine: the server's front end of the engine, on the asyncio event loop.

The engine core (scheduler, KV cache, model) runs elsewhere: in its own process by default
(`MPCoreClient`, over ZeroMQ), in a thread with `PAGEDLLM_ENGINE_IN_PROCESS=1`
(`InprocCoreClient`). With `data_parallel_size=M` there are M cores and a `Router` picks one
per request; with `distributed_executor_backend="ray"` those M cores are Ray actors placed on
the cluster (`RayCoreClient`, one placement-group bundle each). This side tokenizes nothing itself (the server hands it token ids), turns the
cores' token deltas into `RequestOutput`s (`OutputProcessor`: detokenization, stop strings)
and fans them out to one `RequestStream` per request.

    stream = await engine.add_request(request_id, prompt, params)   # ValueError: rejected
    async for output in engine.generate(prompt, params, request_id):  # params.output_kind
        ...

A pooling model's requests take the same path (`pool(params, work)`: prepared by
`pooling_inputs`, one `PoolingRequestOutput` back), so its server has the same metrics and
dashboard.

Leaving the `generate` iterator early (the client went away, the handler task was cancelled)
aborts the request: the core drops it and its KV blocks go back to the pool.

Each add gets a serial number, and the core knows the request as `"<serial>:<request id>"`:
an id that is aborted and added again never receives the old request's outputs.

A core that dies (killed, crashed, out of memory) fails every request it held with an
`EngineDeadError` (503) at once; `/health` answers 503 from then on, and when no core is left
`on_fatal` is called (the server exits non-zero so that its supervisor restarts it). A
`SchedulerStallError` (the core's watchdog) fails the named requests with a 500 and sets
`health_error` (503 on /health until restart); the core goes on serving the others.

Outputs follow `SamplingParams.output_kind` (engine/output_processor.py): CUMULATIVE (the
default here) keeps only the newest unread output of a stream, DELTA (the server's streams)
folds unread deltas into one; either way nothing is lost and a slow client never makes a queue
grow. FINAL_ONLY (the server's plain responses) sends one output.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from pagedllm.engine.async_start import check_fits
from pagedllm.engine.core_messages import EngineCoreOutputs
from pagedllm.engine.core_start import CoreStart
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.errors import STALL_STEPS, SchedulerStallError
from pagedllm.engine.input_processing import InputProcessor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request_stream import RequestStream
from pagedllm.engine.router import Router
from pagedllm.engine.stat_logger import PeriodicStatLogger
from pagedllm.engine.stats_history import StatsHistory
from pagedllm.outputs import RequestOutput
from pagedllm.pooling.outputs import PoolingRequestOutput
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.work import PoolingWork
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.engine import PromptType
    from pagedllm.metrics import EngineMetrics
    from pagedllm.pooling.inputs import PoolingInputs

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core stopped (shutdown, killed, or an error it could not recover from)."""


class AsyncLLMEngine:
    """Streams of `RequestOutput`s from one or more engine cores, for an asyncio server."""

    def __init__(self, clients: list[Any], tokenizer, info: EngineInfo,
                 metrics: "EngineMetrics | None" = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self.clients = clients
        self.tokenizer = tokenizer
        self.info = info
        self.metrics = metrics
        self.stat_logger = PeriodicStatLogger()  # vLLM's periodic "Avg ... throughput" line
        self.stats_history = StatsHistory()  # the dashboard's last minutes (docs/dashboard.md)
        self.on_fatal = on_fatal
        self.inputs = InputProcessor(
            tokenizer, info.vocab_size, info.max_model_len,
            functools.partial(check_fits, num_blocks=info.num_blocks,
                              block_size=info.block_size, groups=info.kv_cache_groups,
                              chunk=info.max_num_batched_tokens),
            max_logprobs=info.max_logprobs, scheduling_policy=info.scheduling_policy,
            max_num_seqs=info.max_num_seqs,
        )
        self.output_processor = OutputProcessor(tokenizer)
        self.router = Router(len(clients), info.block_size)
        self._streams: dict[str, RequestStream] = {}  # core id -> stream (event loop only)
        self._serials = itertools.count()
        self._utility_calls: dict[int, asyncio.Future] = {}
        self.ray_replicas = None  # the Ray placement group of the replicas, if Ray placed them
        self._started = False
        self._stopping = False
        self.dead_error: BaseException | None = None
        self.dead_engines: dict[int, str] = {}
        self._fatal_reported = False
        self._constraint_checker = None  # a thread pool of one, on the first constraint
        # Why the engine is unhealthy (a scheduler stall), or None; /health answers 503 with it.
        self.health_error: str | None = None
        # A pooling model's prompt rule (pooling/inputs.py); None: a generation model.
        self.pooling_inputs: PoolingInputs | None = None

    @classmethod
    def from_engine_config(cls, config: "EngineConfig", with_metrics: bool = True,
                           in_process: bool | None = None,
                           start: CoreStart | None = None) -> "AsyncLLMEngine":
        """Start the core(s) (or take those `start` launched) and wait until they are ready
        (a ValueError: bad configuration); the tokenizer loads meanwhile (engine/async_start.py)."""
        from pagedllm.engine.async_start import start_cores

        started = start_cores(config, with_metrics, in_process, start)
        engine = cls(started.clients, started.tokenizer, started.info, started.metrics)
        engine.ray_replicas = started.ray_replicas
        engine.pooling_inputs = started.pooling_inputs
        engine.inputs.multimodal = started.multimodal
        return engine

    # ---- life cycle (event loop) ----------------------------------------------------------

    def start(self) -> None:
        """Start delivering the cores' outputs; call from the event loop that consumes them."""
        if self._started:
            return
        loop = asyncio.get_running_loop()
        for client in self.clients:
            client.start(loop, self._on_outputs, self._on_death)
        self._started = True

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the cores; open streams fail. Nothing is delivered after this starts."""
        self._stopping = True
        error = EngineDeadError("The server is shutting down.")
        for stream in list(self._streams.values()):
            stream.fail(error)
        self._streams.clear()
        for fut in self._utility_calls.values():
            if not fut.done():
                fut.set_exception(error)
        if self._constraint_checker is not None:
            self._constraint_checker.shutdown(wait=False)
        await asyncio.gather(*(asyncio.to_thread(c.shutdown, timeout) for c in self.clients))
        if getattr(self, "ray_replicas", None) is not None:
            self.ray_replicas.remove()

    @property
    def is_running(self) -> bool:
        return self._started and not self._stopping and bool(self._live_engines())

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    def health_problem(self) -> str | None:
        """Why /health should answer 503, or None."""
        dead = dict(self.dead_engines)
        if not self._stopping:
            for client in self.clients:  # a death the loop has not been told of yet
                how = getattr(client, "ended_how", None)
                if how is not None and not client.alive:
                    dead.setdefault(client.engine_index, how)
        if dead:
            listed = ", ".join(f"{i} ({why})" for i, why in sorted(dead.items()))
            return f"Engine core(s) died: {listed}; restart the server."
        if not self.is_running:
            return "The engine is not running."
        if self.health_error is not None:
            return f"The engine is unhealthy, restart the server: {self.health_error}"
        return None

    # ---- requests (event loop) ------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: "PromptType",
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> RequestStream:
        """Check a request and send it to a core. Raises ValueError when it is rejected."""
        await self._check_constraint(params)
        return self._add(request_id, prompt, params, arrival_time, priority, lora_request)

    async def _check_constraint(self, params: SamplingParams) -> None:
        """A structured-output constraint's syntax (xgrammar's parser, no tokenizer), so that
        a bad one is a 400 before a stream starts. On a thread of its own: a large one
        (0.65 s for a 100,000-item enum) must not stop the event loop, where every stream
        is served, nor the tokenizer thread. Its compilation, in the core's compiler
        process, has a time limit."""
        so = getattr(params, "structured_outputs", None)
        if so is None:
            return
        from pagedllm.structured_output import check_constraint

        if self._constraint_checker is None:
            import concurrent.futures

            self._constraint_checker = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="pagedllm-constraint-check")
        await asyncio.get_running_loop().run_in_executor(self._constraint_checker,
                                                         check_constraint, so)

    def _add(self, request_id: str, prompt: "PromptType", params: SamplingParams,
             arrival_time: float | None = None, priority: int = 0, lora_request: Any = None) -> RequestStream:
        from pagedllm.engine.engine import prepare_request

        if not self.is_running:
            raise EngineDeadError("The engine is not running.") from self.dead_error
        if any(s.request_id == request_id for s in self._streams.values()):
            raise ValueError(f"Request id {request_id!r} is already in use.")
        stream = RequestStream(request_id, next(self._serials),
                               delta=getattr(params, "output_kind", None) is RequestOutputKind.DELTA)
        prompt_text, request = prepare_request(self.inputs, stream.core_id, prompt, params,
                                               arrival_time, priority=priority, lora_request=lora_request)
        live = self._live_engines()
        if not live:
            raise EngineDeadError("The engine is not running.") from self.dead_error
        stream.engine_index = self.router.choose(request, live, request.cache_salt)
        try:
            self.output_processor.add_request(
                stream.core_id, prompt_text, request.prompt_token_ids, request.sampling_params,
                request.arrival_time, is_beam=request.beam_params is not None,
                external_id=request_id, lora_request=request.lora_request,
            )
            self._streams[stream.core_id] = stream
            self.router.started(stream.engine_index)
            self.clients[stream.engine_index].add_request(request)
        except BaseException:
            # Nothing of a request that was never sent may stay behind.
            if self._streams.pop(stream.core_id, None) is not None:
                self.router.finished(stream.engine_index)
            self.output_processor.abort_request(stream.core_id)
            raise
        return stream

    async def pool(self, params: PoolingParams, work: PoolingWork) -> PoolingRequestOutput:
        """Run one prepared pooling request (`PoolingInputs.prepare_many`) to its output, a
        request of the core like any other; cancelled (the client went away): aborted."""
        from pagedllm.engine.engine import pooling_core_request

        live = self._live_engines() if self.is_running else []
        if not live:
            raise EngineDeadError("The engine is not running.") from self.dead_error
        stream = RequestStream(work.request_id, next(self._serials))
        request = pooling_core_request(stream.core_id, params, work)
        stream.engine_index = self.router.choose(request, live, None)
        self.output_processor.add_pooling_request(stream.core_id, work.token_ids, request.arrival_time,
                                                  external_id=work.request_id)
        self._streams[stream.core_id] = stream
        self.router.started(stream.engine_index)
        self.clients[stream.engine_index].add_request(request)
        try:
            return await stream.get()
        finally:
            if not stream.finished:
                self._abort_stream(stream)

    def _live_engines(self) -> list[int]:
        return [i for i, c in enumerate(self.clients) if c.alive and i not in self.dead_engines]

    async def add_requests(
        self, requests: list[tuple[str, "PromptType"]], params: SamplingParams,
        priority: int = 0, lora_request: Any = None,
    ) -> list[RequestStream]:
        """Add several requests at once; if any is rejected, the others are aborted and its
        error is raised."""
        await self._check_constraint(params)
        streams: list[RequestStream] = []
        try:
            for rid, prompt in requests:
                streams.append(self._add(rid, prompt, params, priority=priority, lora_request=lora_request))
        except BaseException:
            self.abort_unfinished(streams)
            raise
        return streams

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

    async def final_output(self, stream: RequestStream) -> RequestOutput | None:
        """The request's last output (None if it ended without one). However the caller
        leaves (also cancelled before the first output), an unfinished request is aborted."""
        final: RequestOutput | None = None
        try:
            async for out in self.stream_outputs(stream):
                final = out
        finally:
            self.abort_unfinished([stream])
        return final

    async def generate(
        self,
        prompt: "PromptType",
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """add_request + stream_outputs: the request's outputs until the finished one."""
        stream = await self.add_request(request_id, prompt, params, arrival_time, lora_request=lora_request)
        async for out in self.stream_outputs(stream):
            yield out

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        """Abort every request of `streams` whose finished output was not consumed."""
        for stream in streams:
            if not stream.finished:
                self._abort_stream(stream)

    def abort(self, request_id: str) -> None:
        """Abort the request now known by `request_id` (no-op if it already finished)."""
        for stream in list(self._streams.values()):
            if stream.request_id == request_id:
                self._abort_stream(stream)

    def _abort_stream(self, stream: RequestStream) -> None:
        stream.finished = True
        if self._streams.pop(stream.core_id, None) is None:
            return  # finished or failed already: the core holds nothing of it
        self.output_processor.abort_request(stream.core_id)
        self.router.finished(stream.engine_index)
        client = self.clients[stream.engine_index]
        if client.alive:
            client.abort_requests([stream.core_id])
        if self.metrics is not None:
            self.metrics.record_abort(stream.request_id, stream.engine_index)

    async def call_utility(self, name: str, *args: Any, engine_index: int = 0) -> Any:
        """Run an `EngineCore.utility` call in a core (e.g. reset_prefix_cache)."""
        call_id = next(self._serials)
        fut = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = fut
        self.clients[engine_index].call_utility(call_id, name, list(args))
        try:
            return await fut
        finally:
            self._utility_calls.pop(call_id, None)

    # ---- delivery (event loop; scheduled by the clients' threads) -------------------------

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        if self._stopping:
            return
        try:
            self._deliver(outputs)
        except Exception as exc:
            # A bug on this side (detokenizing, a stop string, metrics): the requests of this
            # message fail with a 500 and leave the core; the others go on.
            logger.exception("Could not process engine core %d's outputs", outputs.engine_index)
            self._fail_requests([o.request_id for o in outputs.outputs], outputs.engine_index,
                                RuntimeError(f"The server could not process this request's "
                                             f"output: {exc!r}"))
        if outputs.fatal_error is not None:
            self._on_death(outputs.engine_index, outputs.fatal_error)

    def _deliver(self, outputs: EngineCoreOutputs) -> None:
        if outputs.utility_result is not None:
            call_id, result, ok = outputs.utility_result
            fut = self._utility_calls.get(call_id)
            if fut is not None and not fut.done():
                if ok:
                    fut.set_result(json.loads(result))
                else:
                    fut.set_exception(RuntimeError(result))
        if outputs.health_error is not None:
            self.health_error = outputs.health_error
        now = time.time()
        processed = self.output_processor.process_outputs(outputs.outputs, now)
        if processed.finish_samples:  # stop strings ended these samples: free them
            client = self.clients[outputs.engine_index]
            if client.alive:
                client.finish_samples(processed.finish_samples)
        for core_id, out in processed.request_outputs:
            stream = self._streams.get(core_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[core_id]
                self.router.finished(stream.engine_index)
        for core_id, message, kind in processed.errors:
            stream = self._streams.pop(core_id, None)
            if stream is None:
                continue
            self.router.finished(stream.engine_index)
            stream.fail(_request_error(stream.request_id, message, kind))
            if self.metrics is not None:
                self.metrics.record_error(stream.request_id, stream.engine_index)
        if self.metrics is not None:
            self.metrics.record_step(processed.step_stats, now,
                                     outputs.engine_index)
            if outputs.stats is not None:
                self.metrics.update_from_stats(outputs.stats, outputs.engine_index)
        if outputs.stats is not None:
            self.stat_logger.observe(outputs.stats, outputs.engine_index)
            self.stats_history.observe(outputs.stats, outputs.engine_index,
                                       generation_tokens=self._generation_tokens(outputs.engine_index))

    def _generation_tokens(self, engine_index: int):
        """A reader of /metrics' generated-token counter of one core (None without metrics)."""
        metrics = self.metrics
        if metrics is None:
            return None
        labels = {"model_name": metrics.model_name, "engine": str(engine_index)}
        return lambda: metrics.registry.get_sample_value("vllm:generation_tokens_total", labels)

    def _fail_requests(self, core_ids: list[str], engine_index: int,
                       error: BaseException) -> None:
        """Fail these requests here and drop them in the core (each at most once)."""
        failed = []
        for core_id in core_ids:
            stream = self._streams.pop(core_id, None)
            try:
                self.output_processor.abort_request(core_id)
            except Exception:
                logger.exception("Could not drop request %s's output state", core_id)
            if stream is None:
                continue
            failed.append(core_id)
            self.router.finished(stream.engine_index)
            stream.fail(error)
            if self.metrics is not None:
                self.metrics.record_error(stream.request_id, stream.engine_index)
        client = self.clients[engine_index]
        if failed and client.alive:
            client.abort_requests(failed)

    def _on_death(self, engine_index: int, how: str) -> None:
        if self._stopping:
            return
        first = self.dead_engines.get(engine_index)
        self.dead_engines[engine_index] = how if first is None or first == how else f"{first}; {how}"
        error = EngineDeadError(f"The engine core {engine_index} died ({how}); "
                                "the server must be restarted.")
        self.dead_error = error
        for core_id, stream in list(self._streams.items()):
            if stream.engine_index == engine_index:
                del self._streams[core_id]
                self.output_processor.abort_request(core_id)
                stream.fail(error)
                if self.metrics is not None:
                    self.metrics.record_error(stream.request_id, engine_index)
        self.router.reset(engine_index)
        if not self._live_engines() and self.on_fatal is not None and not self._fatal_reported:
            self._fatal_reported = True
            self.on_fatal(str(error))


def _request_error(request_id: str, message: str, kind: str) -> BaseException:
    if kind == "invalid":
        return ValueError(message)
    if kind == "fatal":
        return EngineDeadError(message)
    if kind == "stall":
        return SchedulerStallError([request_id], STALL_STEPS,
                                   "the request was aborted; the server reports itself "
                                   "unhealthy until restarted")
    return RuntimeError(message)


AsyncLLM = AsyncLLMEngine

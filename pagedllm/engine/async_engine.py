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
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.core.scheduler_config import check_request_fits_pool
from pagedllm.core.kv_cache_groups import hybrid_groups_of_windows
from pagedllm.engine.stat_logger import PeriodicStatLogger
from pagedllm.engine.stats_history import StatsHistory
from pagedllm.engine.core_messages import CoreReady, EngineCoreOutputs
from pagedllm.engine.core_start import IN_PROCESS_ENV, CoreStart, in_process_requested
from pagedllm.engine.errors import STALL_STEPS, SchedulerStallError
from pagedllm.engine.generation_defaults import load_generation_defaults
from pagedllm.engine.input_processing import InputProcessor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.router import Router
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.engine import PromptType
    from pagedllm.metrics import EngineMetrics

logger = logging.getLogger(__name__)


def _config_vocab_size(source: Any) -> int:
    """The model config's vocabulary size (a core whose hand-shake did not carry one)."""
    from pagedllm.model_source import load_hf_config

    return int(load_hf_config(source).vocab_size)


class EngineDeadError(RuntimeError):
    """The engine core stopped (shutdown, killed, or an error it could not recover from)."""


@dataclass
class EngineInfo:
    """What the server needs to know of the engine it fronts (from the core's hand-shake)."""

    model_name: str
    model_root: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    chat_template: str | None
    startup_seconds: float
    kernel_info: dict[str, str]
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20
    max_num_seqs: int = 256  # bounds n / best_of / the beam width of a request
    # generation_config.json's sampling defaults (engine/generation_defaults.py)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # every --served-model-name (model_name is the first); empty: model_name only
    served_model_names: list[str] = field(default_factory=list)
    # a hybrid KV cache (the core's KVCacheManager groups) and the step's token budget: the
    # fit check's peak per sequence (core/scheduler.check_request_fits_pool)
    kv_cache_groups: Any = None
    max_num_batched_tokens: int = 0


class RequestStream:
    """The outputs of one request, on the event loop: what was not read yet, or an error.
    An unread CUMULATIVE output is superseded by the next, an unread DELTA one absorbs it
    (`RequestOutput.add`). Only the event loop thread touches it."""

    def __init__(self, request_id: str, serial: int = -1, delta: bool = False) -> None:
        self.request_id = request_id
        self.serial = serial  # unique per add: tells apart requests that reuse an id
        self.core_id = f"{serial}:{request_id}"
        self.engine_index = 0
        self.finished = False
        self.delta = delta
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self.delta and self._latest is not None:
            self._latest.add(output)
        else:
            self._latest = output
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
            functools.partial(_check_fits, num_blocks=info.num_blocks,
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

    @classmethod
    def from_engine_config(cls, config: "EngineConfig", with_metrics: bool = True,
                           in_process: bool | None = None,
                           start: CoreStart | None = None) -> "AsyncLLMEngine":
        """Start the core(s) (or take those `start` launched) and wait until they are ready
        (a ValueError: bad configuration); the tokenizer loads meanwhile."""
        from pagedllm.tokenizer import load_tokenizer

        if start is None:
            if in_process is None:
                in_process = in_process_requested()
            replicas = getattr(config, "data_parallel_size", 1)
            if in_process and replicas != 1:
                raise ValueError(f"{IN_PROCESS_ENV}=1 runs one engine core in this process; "
                                 f"data_parallel_size={replicas} needs core processes.")
            start = CoreStart(config, in_process=in_process)
        source, tok_source, config = start.source, start.tok_source, start.config
        try:
            tokenizer = load_tokenizer(tok_source.path, tok_source.gguf_file)
        except BaseException:
            start.abandon()
            raise
        clients = start.clients()
        ray_replicas = start.ray_replicas
        for c in clients:
            logger.info("Engine core %d ready in %.1f s (pid %d)", c.engine_index,
                        c.ready.startup_seconds, c.ready.pid)
        ready: CoreReady = clients[0].ready
        info = EngineInfo(
            model_name=ready.model_name,
            model_root=os.path.join(source.path, source.gguf_file) if source.gguf_file
            else source.path,
            max_model_len=ready.max_model_len,
            vocab_size=ready.vocab_size or _config_vocab_size(source),
            num_blocks=min(c.ready.num_blocks for c in clients),
            block_size=ready.block_size,
            chat_template=config.chat_template,
            startup_seconds=max(c.ready.startup_seconds for c in clients),
            kernel_info=ready.kernel_info,
            scheduling_policy=config.scheduling_policy,
            max_logprobs=config.max_logprobs,
            max_num_seqs=config.max_num_seqs,
            generation_defaults=load_generation_defaults(config.generation_config, source.path,
                                                         bool(source.gguf_file)),
            served_model_names=config.served_model_names,
            kv_cache_groups=hybrid_groups_of_windows(ready.hybrid_layer_windows),
            max_num_batched_tokens=ready.max_num_batched_tokens,
        )
        metrics = None
        if with_metrics:
            from pagedllm.metrics import (EngineMetrics, cache_config_labels,
                                          kv_cache_group_attention)

            metrics = EngineMetrics(
                info.model_name, num_engines=len(clients), kernel_info=info.kernel_info or None,
                max_model_len=info.max_model_len,
                cache_info=[cache_config_labels(config, c.ready.num_blocks, c.ready.block_size)
                            for c in clients],
                kv_cache_group_attention=kv_cache_group_attention(info.kv_cache_groups))
        engine = cls(clients, tokenizer, info, metrics)
        engine.ray_replicas = ray_replicas
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


def _check_fits(num_tokens: int, num_lockstep_seqs: int = 1, *, num_blocks: int,
                block_size: int, groups: Any = None, chunk: int = 0) -> None:
    check_request_fits_pool(num_tokens, num_lockstep_seqs, num_blocks, block_size, groups, chunk)


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

"""Prometheus metrics of a serving engine (vLLM's set, named `pagedllm:*`).

Every metric carries the labels `model_name` and `engine` (the engine core's index: "0", or
"0".."M-1" with --data-parallel-size M), kernel_info only the first. Served at `GET /metrics`
in the Prometheus text format. The front end feeds them on its event loop: `record_step` for
each core step's outputs (tokens, latencies, finished requests), `record_abort` when a request
is aborted, `update_from_stats` with the `CoreStats` a core sends after its steps (gauges, and
its cumulative KV cache counters).

Gauges:      pagedllm:num_requests_running, pagedllm:num_requests_waiting,
             pagedllm:num_requests_swapped,
             pagedllm:kv_cache_usage_perc (fraction of KV blocks held by a request, 0..1),
             pagedllm:kv_cache_used_blocks
Counters:    pagedllm:prompt_tokens_total, pagedllm:generation_tokens_total,
             pagedllm:request_success_total{finished_reason="stop"|"length"|"abort"},
             pagedllm:prefix_cache_queries_total, pagedllm:prefix_cache_hits_total (tokens),
             pagedllm:num_preemptions_total
Info:        pagedllm:kernel_info{path="c"|"torch"|"mixed", kernels="<active C kernels>",
             inactive="<kernels on the torch path>", cpu_features="avx2,avx512f,..."} 1
             (kernels/status.py: which compute path this server runs)
Histograms:  pagedllm:time_to_first_token_seconds, pagedllm:inter_token_latency_seconds (one
             sample per request per step that gave it tokens), pagedllm:e2e_request_latency_seconds,
             pagedllm:request_queue_time_seconds (arrival to first scheduled)

A request counts once in request_success_total, with the finish reason of its first sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from pagedllm.engine.core_messages import CoreStats
    from pagedllm.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class _Seen:
    """What the previous steps showed of one request."""

    num_tokens: int = 0
    last_token_time: float | None = None
    first_token_recorded: bool = False


class EngineMetrics:
    """The registry of one server; every metric but kernel_info per engine core (`engine`
    label, "0".."M-1" with data parallelism, as vLLM v1 labels them)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 num_engines: int = 1, kernel_info: dict[str, str] | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        reg, names = self.registry, ["model_name", "engine"]
        engines = [str(i) for i in range(num_engines)]

        def per_engine(metric) -> list:
            return [metric.labels(model_name, e) for e in engines]

        def gauge(metric: str, doc: str) -> list[Gauge]:
            return per_engine(Gauge(metric, doc, names, registry=reg))

        def counter(metric: str, doc: str) -> list[Counter]:
            return per_engine(Counter(metric, doc, names, registry=reg))

        def histogram(metric: str, doc: str, buckets) -> list[Histogram]:
            return per_engine(Histogram(metric, doc, names, buckets=buckets, registry=reg))

        self.num_requests_running = gauge("pagedllm:num_requests_running",
                                          "Number of requests in the running batch.")
        self.num_requests_waiting = gauge("pagedllm:num_requests_waiting",
                                          "Number of requests waiting to be scheduled.")
        self.num_requests_swapped = gauge("pagedllm:num_requests_swapped",
                                          "Number of preempted requests swapped to host memory.")
        self.kv_cache_usage = gauge("pagedllm:kv_cache_usage_perc",
                                    "Fraction of KV cache blocks in use (1 = full).")
        self.kv_cache_used_blocks = gauge("pagedllm:kv_cache_used_blocks",
                                          "Number of KV cache blocks held by requests.")
        self.prompt_tokens = counter("pagedllm:prompt_tokens",
                                     "Number of prefilled prompt tokens.")
        self.generation_tokens = counter("pagedllm:generation_tokens",
                                         "Number of generated tokens.")
        self.prefix_cache_queries = counter("pagedllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("pagedllm:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("pagedllm:num_preemptions",
                                       "Number of preemptions of running requests.")
        success = Counter("pagedllm:request_success", "Number of finished requests by reason.",
                          ["model_name", "engine", "finished_reason"], registry=reg)
        self.request_success = [{r: success.labels(model_name, e, r) for r in FINISH_REASONS}
                                for e in engines]
        self.time_to_first_token = histogram("pagedllm:time_to_first_token_seconds",
                                             "Time from arrival to the first token.",
                                             _TTFT_BUCKETS)
        self.inter_token_latency = histogram("pagedllm:inter_token_latency_seconds",
                                             "Time between two steps that gave a request tokens.",
                                             _ITL_BUCKETS)
        self.e2e_latency = histogram("pagedllm:e2e_request_latency_seconds",
                                     "Time from arrival to the last token.", _LATENCY_BUCKETS)
        self.queue_time = histogram("pagedllm:request_queue_time_seconds",
                                    "Time from arrival to the first step that ran the request.",
                                    _LATENCY_BUCKETS)
        if kernel_info is None:
            from pagedllm.kernels.status import kernel_status

            kernel_info = kernel_status().info_labels()
        Info("pagedllm:kernel", "Which compute kernels run: the active C kernels (the rest run plain "
             "torch) and the CPU features they are built for.", ["model_name"],
             registry=reg).labels(model_name).info(kernel_info)
        self._seen: dict[str, _Seen] = {}
        self._last: list[dict[str, int]] = [{} for _ in engines]

    # ---- called on the event loop, for each core's step -----------------------------------

    def record_step(self, outputs: list["RequestOutput"], now: float, engine: int = 0) -> None:
        e = engine
        for out in outputs:
            seen = self._seen.setdefault(out.request_id, _Seen())
            m = out.metrics
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            new_tokens = num_tokens - seen.num_tokens
            if new_tokens > 0:
                self.generation_tokens[e].inc(new_tokens)
                if not seen.first_token_recorded:
                    seen.first_token_recorded = True
                    self.prompt_tokens[e].inc(len(out.prompt_token_ids))
                    first = m.first_token_time if m and m.first_token_time else now
                    if m is not None:
                        self.time_to_first_token[e].observe(max(first - m.arrival_time, 0.0))
                        if m.time_in_queue is not None:
                            self.queue_time[e].observe(max(m.time_in_queue, 0.0))
                elif seen.last_token_time is not None:
                    self.inter_token_latency[e].observe(max(now - seen.last_token_time, 0.0))
                seen.num_tokens = num_tokens
                seen.last_token_time = now
            if out.finished:
                del self._seen[out.request_id]
                reason = out.outputs[0].finish_reason if out.outputs else None
                success = self.request_success[e]
                success.get(reason or "stop", success["stop"]).inc()
                if m is not None:
                    end = m.finished_time or now
                    self.e2e_latency[e].observe(max(end - m.arrival_time, 0.0))

    def record_abort(self, request_id: str, engine: int = 0) -> None:
        self._seen.pop(request_id, None)
        self.request_success[engine]["abort"].inc()

    def update_from_stats(self, stats: "CoreStats", engine: int = 0) -> None:
        """The gauges, and the core's cumulative counters (as increments)."""
        e = engine
        self.num_requests_running[e].set(stats.num_running)
        self.num_requests_waiting[e].set(stats.num_waiting)
        self.num_requests_swapped[e].set(stats.num_swapped)
        self.kv_cache_used_blocks[e].set(stats.kv_used_blocks)
        self.kv_cache_usage[e].set(
            stats.kv_used_blocks / stats.kv_num_blocks if stats.kv_num_blocks else 0.0)
        last = self._last[e]
        for counter, name in (
            (self.prefix_cache_queries[e], "prefix_cache_queries"),
            (self.prefix_cache_hits[e], "prefix_cache_hits"),
            (self.num_preemptions[e], "num_preemptions"),
        ):
            value = getattr(stats, name)
            delta = value - last.get(name, 0)
            if delta > 0:
                counter.inc(delta)
            last[name] = value

    # ---- exposition -----------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

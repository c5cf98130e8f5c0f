"""Prometheus metrics of a serving engine (vLLM's set, named `pagedllm:*`).

Every metric carries the label `model_name`. Served at `GET /metrics` in the Prometheus text
format. The engine thread feeds them: `record_step` after every step (tokens, latencies,
finished requests), `record_abort` when a request is aborted, `update_from_engine` after every
loop iteration (gauges, and the engine's cumulative KV cache counters).

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
    from pagedllm.engine.engine import LLMEngine
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
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        reg, name = self.registry, ["model_name"]

        def gauge(metric: str, doc: str) -> Gauge:
            return Gauge(metric, doc, name, registry=reg).labels(model_name)

        def counter(metric: str, doc: str) -> Counter:
            return Counter(metric, doc, name, registry=reg).labels(model_name)

        def histogram(metric: str, doc: str, buckets) -> Histogram:
            return Histogram(metric, doc, name, buckets=buckets, registry=reg).labels(model_name)

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
                          ["model_name", "finished_reason"], registry=reg)
        self.request_success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
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
        from pagedllm.kernels.status import kernel_status

        Info("pagedllm:kernel", "Which compute kernels run: the active C kernels (the rest run plain "
             "torch) and the CPU features they are built for.", name,
             registry=reg).labels(model_name).info(kernel_status().info_labels())
        self._seen: dict[str, _Seen] = {}
        self._last_queries = self._last_hits = self._last_preemptions = 0

    # ---- called by the engine thread ------------------------------------------------------

    def record_step(self, outputs: list["RequestOutput"], now: float) -> None:
        for out in outputs:
            seen = self._seen.setdefault(out.request_id, _Seen())
            m = out.metrics
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            new_tokens = num_tokens - seen.num_tokens
            if new_tokens > 0:
                self.generation_tokens.inc(new_tokens)
                if not seen.first_token_recorded:
                    seen.first_token_recorded = True
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                    first = m.first_token_time if m and m.first_token_time else now
                    if m is not None:
                        self.time_to_first_token.observe(max(first - m.arrival_time, 0.0))
                        if m.time_in_queue is not None:
                            self.queue_time.observe(max(m.time_in_queue, 0.0))
                elif seen.last_token_time is not None:
                    self.inter_token_latency.observe(max(now - seen.last_token_time, 0.0))
                seen.num_tokens = num_tokens
                seen.last_token_time = now
            if out.finished:
                del self._seen[out.request_id]
                reason = out.outputs[0].finish_reason if out.outputs else None
                self.request_success.get(reason or "stop", self.request_success["stop"]).inc()
                if m is not None:
                    end = m.finished_time or now
                    self.e2e_latency.observe(max(end - m.arrival_time, 0.0))

    def record_abort(self, request_id: str) -> None:
        self._seen.pop(request_id, None)
        self.request_success["abort"].inc()

    def update_from_engine(self, engine: "LLMEngine") -> None:
        sched = engine.scheduler
        self.num_requests_running.set(len({s.request_id for s in sched.running}))
        self.num_requests_waiting.set(len({s.request_id for s in sched.waiting}))
        swapped = getattr(sched, "swapped", ())  # groups of one request's sequences
        self.num_requests_swapped.set(len({s.request_id for g in swapped for s in g}))
        kv = engine.kv_cache_manager
        used = kv.num_blocks - kv.num_free_blocks
        self.kv_cache_used_blocks.set(used)
        self.kv_cache_usage.set(used / kv.num_blocks if kv.num_blocks else 0.0)
        stats = engine.kv_cache_stats()
        for counter, attr, value in (
            (self.prefix_cache_queries, "_last_queries", stats.prefix_cache_queries),
            (self.prefix_cache_hits, "_last_hits", stats.prefix_cache_hits),
            (self.num_preemptions, "_last_preemptions", stats.num_preemptions),
        ):
            delta = value - getattr(self, attr)
            if delta > 0:
                counter.inc(delta)
            setattr(self, attr, value)

    # ---- exposition -----------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

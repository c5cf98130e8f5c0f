"""Prometheus metrics of a serving engine: vLLM's names (`vllm:*`), and `pagedllm:*` only for what vLLM lacks.

Served at `GET /metrics` in the Prometheus text format. The `vllm:*` series carry vLLM v1's
names, types, label names (`model_name`, `engine`: the engine core's index, "0".."M-1" with
--data-parallel-size M) and histogram buckets, so that dashboards and scripts written for vLLM
(vLLM's own dashboard included: examples/prometheus_grafana/README.md) read pagedllm unchanged. The
`pagedllm:*` series are what vLLM has no name for (swapped requests, used blocks, KV cache
groups, the kernel path); no figure is exported twice. docs/metrics.md lists every series and
where its figures come from.

The front end feeds them on its event loop: `record_step` with each core step's per-request stats from the
`OutputProcessor` (tokens, latencies, finished requests, whatever the outputs hold), `record_abort` when a request is aborted, `update_from_stats`
with the `CoreStats` a core sends after its steps (gauges, cumulative KV cache and preemption
counters, the tokens of each step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedllm.kernels.status import kernel_status

if TYPE_CHECKING:
    from pagedllm.engine.core_messages import CoreStats
    from pagedllm.engine.output_processor import RequestStepStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's bucket boundaries (vllm/v1/metrics/buckets.py): the same edges give the same quantiles.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM v1's FinishReason strings


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


def cache_config_labels(config: Any, num_blocks: int, block_size: int) -> dict[str, str]:
    """The labels of vllm:cache_config_info, under vLLM's CacheConfig field names, for the
    settings pagedllm has (num_gpu_blocks: the KV pool's blocks, on whichever device)."""
    labels = {
        "block_size": str(block_size),
        "num_gpu_blocks": str(num_blocks),
        "kv_cache_size_tokens": str(num_blocks * block_size),
    }
    for name, label in (("enable_prefix_caching", "enable_prefix_caching"),
                        ("kv_cache_dtype", "cache_dtype"), ("swap_space", "swap_space")):
        value = getattr(config, name, None)
        if value is not None:
            labels[label] = str(value)
    return labels


def kv_cache_group_attention(groups: Any) -> list[str]:
    """The `attention` label of each KV cache group ("full", "sliding_window=W"); empty when
    the core keeps one table for every layer (no groups, so no per-group series)."""
    if groups is None:
        return []
    return ["full" if g.sliding_window is None else f"sliding_window={g.sliding_window}"
            for g in groups.groups]


@dataclass
class _Seen:
    """What the previous steps showed of one request."""

    num_tokens: int = 0
    last_token_time: float | None = None
    first_token_recorded: bool = False


class EngineMetrics:
    """The registry of one server; every metric but the info ones per engine core (`engine`
    label, "0".."M-1" with data parallelism, as vLLM v1 labels them)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 num_engines: int = 1, kernel_info: dict[str, str] | None = None,
                 max_model_len: int = 2048,
                 cache_info: list[dict[str, str]] | None = None,
                 kv_cache_group_attention: list[str] | None = None) -> None:
        """`kv_cache_group_attention`: each KV cache group's attention ("full",
        "sliding_window=W") for the per-group series; None or empty: one table, no such series."""
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

        def by_reason(metric: str, doc: str) -> list[dict[str, Counter]]:
            c = Counter(metric, doc, ["model_name", "engine", "finished_reason"], registry=reg)
            return [{r: c.labels(model_name, e, r) for r in FINISH_REASONS} for e in engines]

        # ---- vLLM's names (vllm/v1/metrics/loggers.py PrometheusStatLogger) ---------------
        self.v_running = gauge("vllm:num_requests_running",
                               "Number of requests in model execution batches.")
        self.v_waiting = gauge("vllm:num_requests_waiting",
                               "Number of requests waiting to be processed.")
        self.v_kv_usage = gauge("vllm:kv_cache_usage_perc",
                                "KV-cache usage. 1 means 100 percent usage.")
        self.v_prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.v_prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.v_preemptions = counter("vllm:num_preemptions",
                                     "Cumulative number of preemption from the engine.")
        self.v_prompt_tokens = counter("vllm:prompt_tokens",
                                       "Number of prefill tokens processed.")
        self.v_generation_tokens = counter("vllm:generation_tokens",
                                           "Number of generation tokens processed.")
        self.v_prompt_cached = counter("vllm:prompt_tokens_cached",
                                       "Number of cached prompt tokens (local + external).")
        self.v_success = by_reason("vllm:request_success",
                                   "Count of successfully processed requests.")
        tokens = request_tokens_buckets(max_model_len)
        self.v_req_prompt = histogram("vllm:request_prompt_tokens",
                                      "Number of prefill tokens processed.", tokens)
        self.v_req_generation = histogram("vllm:request_generation_tokens",
                                          "Number of generation tokens processed.", tokens)
        self.v_iteration = histogram("vllm:iteration_tokens_total",
                                     "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKENS_BUCKETS)
        self.v_prefill_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens)
        self.v_max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tokens)
        self.v_ttft = histogram("vllm:time_to_first_token_seconds",
                                "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.v_itl = histogram("vllm:inter_token_latency_seconds",
                               "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        # vLLM 0.8-0.10's name of the same samples, which vLLM's older dashboards chart.
        self.v_tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. "
            "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", ITL_BUCKETS)
        self.v_req_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.v_e2e = histogram("vllm:e2e_request_latency_seconds",
                               "Histogram of e2e request latency in seconds.",
                               REQUEST_LATENCY_BUCKETS)
        self.v_queue = histogram("vllm:request_queue_time_seconds",
                                 "Histogram of time spent in WAITING phase for request.",
                                 REQUEST_LATENCY_BUCKETS)
        self.v_inference = histogram("vllm:request_inference_time_seconds",
                                     "Histogram of time spent in RUNNING phase for request.",
                                     REQUEST_LATENCY_BUCKETS)
        self.v_prefill = histogram("vllm:request_prefill_time_seconds",
                                   "Histogram of time spent in PREFILL phase for request.",
                                   REQUEST_LATENCY_BUCKETS)
        self.v_decode = histogram("vllm:request_decode_time_seconds",
                                  "Histogram of time spent in DECODE phase for request.",
                                  REQUEST_LATENCY_BUCKETS)
        # vLLM emulates Info with a gauge at 1 (it works in multiprocess mode); so do we, with
        # the same name and the `engine` label among the config labels.
        info = cache_info or [{} for _ in engines]
        keys = sorted({k for labels in info for k in labels})
        cache_gauge = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                            ["model_name", "engine", *keys], registry=reg)
        for e, labels in zip(engines, info):
            cache_gauge.labels(model_name, e, *(labels.get(k, "") for k in keys)).set(1)

        # ---- pagedllm's own: only what vLLM has no name for ------------------------------
        self.num_requests_swapped = gauge("pagedllm:num_requests_swapped",
                                          "Number of preempted requests swapped to host memory.")
        self.kv_cache_used_blocks = gauge("pagedllm:kv_cache_used_blocks",
                                          "Number of KV cache blocks held by requests.")
        # A hybrid / sliding KV cache (docs/hybrid_kv_cache.md): vLLM has no per-group series.
        attention = kv_cache_group_attention or []
        group_used = Gauge("pagedllm:kv_cache_group_used_blocks",
                           "KV cache blocks held by each KV cache group's block tables.",
                           ["model_name", "engine", "kv_cache_group", "attention"], registry=reg)
        self.kv_cache_group_used_blocks = [
            [group_used.labels(model_name, e, str(g), a) for g, a in enumerate(attention)]
            for e in engines]
        self.sliding_blocks_freed = counter(
            "pagedllm:kv_cache_sliding_blocks_freed",
            "Blocks that sliding-window groups gave back as their windows moved on.")
        # Image inputs (core/encoder_cache.py): vLLM's multi-modal cache counters, in images.
        self.v_mm_queries = counter("vllm:mm_cache_queries",
                                    "Multi-modal cache queries: a sequence's first need of an image's embedding.")
        self.v_mm_hits = counter("vllm:mm_cache_hits",
                                 "Multi-modal cache hits: needs served by rows already encoded.")
        self.mm_images_encoded = counter("pagedllm:mm_images_encoded",
                                         "Images run through the vision encoder (rate: images per second).")
        self.mm_rows_encoded = counter("pagedllm:mm_embedding_rows_encoded",
                                       "Embedding rows the vision encoder produced.")
        self.encoder_cache_usage = gauge("pagedllm:encoder_cache_usage_perc",
                                         "Encoder cache usage (rows held / capacity). 1 means 100 percent usage.")
        # Speculative decoding (vllm/v1/spec_decode/metrics.py's names and labels).
        self.v_spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.v_spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.v_spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.",
                                     ["model_name", "engine", "position"], registry=reg)
        # Multi-LoRA (vLLM's vllm:lora_requests_info: one series per engine, set to the time of
        # the update, its labels the adapters of running / waiting requests, comma-separated).
        self._lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                ["max_lora", "waiting_lora_adapters", "running_lora_adapters", "engine"],
                                registry=reg)
        self._lora_labels: list[tuple[str, ...] | None] = [None for _ in engines]
        if kernel_info is None:
            kernel_info = kernel_status().info_labels()
        Info("pagedllm:kernel", "Which compute kernels run: the active C kernels (the rest run plain "
             "torch) and the CPU features they are built for.", ["model_name"],
             registry=reg).labels(model_name).info(kernel_info)
        self._seen: dict[str, _Seen] = {}
        self._last: list[dict[str, int]] = [{} for _ in engines]

    # ---- called on the event loop, for each core's step -----------------------------------

    def record_step(self, steps: list["RequestStepStats"], now: float, engine: int = 0) -> None:
        """One core step's `OutputProcessor` stats: tokens, TTFT / ITL, finished requests
        (the same whatever each request's output kind sends)."""
        e = engine
        for st in steps:
            seen = self._seen.setdefault(st.request_id, _Seen())
            m = st.metrics
            num_tokens = m.num_generation_tokens
            new_tokens = num_tokens - seen.num_tokens
            if new_tokens > 0:
                self.v_generation_tokens[e].inc(new_tokens)
                if not seen.first_token_recorded:
                    seen.first_token_recorded = True
                    self.v_prompt_tokens[e].inc(st.prompt_len)
                    if st.num_cached_tokens:
                        self.v_prompt_cached[e].inc(st.num_cached_tokens)
                    first = m.first_token_time or now
                    ttft = max(first - m.arrival_time, 0.0)
                    self.v_ttft[e].observe(ttft)
                elif seen.last_token_time is not None:
                    itl = max(now - seen.last_token_time, 0.0)
                    self.v_itl[e].observe(itl)
                    self.v_tpot[e].observe(itl)
                seen.num_tokens = num_tokens
                seen.last_token_time = now
            if st.finished:
                del self._seen[st.request_id]
                if not seen.first_token_recorded:  # finished without a token (a pooling request)
                    self.v_prompt_tokens[e].inc(st.prompt_len)
                    if st.num_cached_tokens:
                        self.v_prompt_cached[e].inc(st.num_cached_tokens)
                reason = st.finish_reason if st.finish_reason in FINISH_REASONS else "stop"
                self.v_success[e][reason].inc()
                self._record_finished(st, m, now, e)

    def _record_finished(self, st: "RequestStepStats", m, now: float, e: int) -> None:
        """vLLM's per-request histograms, observed once when the request finishes."""
        end = m.finished_time or now
        self.v_e2e[e].observe(max(end - m.arrival_time, 0.0))
        self.v_req_prompt[e].observe(st.prompt_len)
        self.v_req_generation[e].observe(m.num_generation_tokens)
        if st.num_cached_tokens is not None:
            self.v_prefill_computed[e].observe(st.prompt_len - max(st.num_cached_tokens, 0))
        self.v_max_generation[e].observe(st.longest)
        for hist, value in ((self.v_queue, m.time_in_queue), (self.v_prefill, m.prefill_time),
                            (self.v_decode, m.decode_time), (self.v_inference, m.inference_time)):
            if value is not None:
                hist[e].observe(max(value, 0.0))
        decode = m.decode_time
        if decode is not None:
            # vLLM: decode time over the tokens after the first; 0 for a one-token request.
            self.v_req_tpot[e].observe(max(decode, 0.0) / (st.longest - 1)
                                       if st.longest > 1 else 0.0)

    def record_abort(self, request_id: str, engine: int = 0) -> None:
        self._seen.pop(request_id, None)
        self.v_success[engine]["abort"].inc()

    def record_error(self, request_id: str, engine: int = 0) -> None:
        """A request that failed (refused by the core, a step or its core died): finished
        with vLLM's "error" reason, and forgotten."""
        self._seen.pop(request_id, None)
        self.v_success[engine]["error"].inc()

    def update_from_stats(self, stats: "CoreStats", engine: int = 0) -> None:
        """The gauges, the core's cumulative counters (as increments), the steps' tokens."""
        e = engine
        usage = stats.kv_used_blocks / stats.kv_num_blocks if stats.kv_num_blocks else 0.0
        self.v_running[e].set(stats.num_running)
        self.v_waiting[e].set(stats.num_waiting)
        self.v_kv_usage[e].set(usage)
        self.num_requests_swapped[e].set(stats.num_swapped)
        self.kv_cache_used_blocks[e].set(stats.kv_used_blocks)
        if stats.encoder_cache_capacity:
            self.encoder_cache_usage[e].set(stats.encoder_cache_rows / stats.encoder_cache_capacity)
        last = self._last[e]
        for counters, name in (
            ((self.v_prefix_queries,), "prefix_cache_queries"),
            ((self.v_prefix_hits,), "prefix_cache_hits"),
            ((self.v_preemptions,), "num_preemptions"),
            ((self.sliding_blocks_freed,), "sliding_blocks_freed"),
            ((self.v_mm_queries,), "mm_cache_queries"),
            ((self.v_mm_hits,), "mm_cache_hits"),
            ((self.mm_images_encoded,), "mm_images_encoded"),
            ((self.mm_rows_encoded,), "mm_rows_encoded"),
            ((self.v_spec_drafts,), "spec_num_drafts"),
            ((self.v_spec_draft_tokens,), "spec_num_draft_tokens"),
            ((self.v_spec_accepted,), "spec_num_accepted_tokens"),
        ):
            value = getattr(stats, name)
            delta = value - last.get(name, 0)
            if delta > 0:
                for c in counters:
                    c[e].inc(delta)
            last[name] = value
        for pos, value in enumerate(stats.spec_accepted_per_pos):
            key = f"spec_pos_{pos}"
            delta = value - last.get(key, 0)
            if delta > 0:
                self._spec_per_pos.labels(self.model_name, str(e), str(pos)).inc(delta)
            last[key] = value
        for gauge_, used in zip(self.kv_cache_group_used_blocks[e], stats.kv_used_blocks_by_group):
            gauge_.set(used)
        for n in getattr(stats, "iteration_tokens", ()):
            self.v_iteration[e].observe(n)
        if getattr(stats, "max_lora", 0):
            labels = (str(stats.max_lora), ",".join(stats.waiting_lora_adapters),
                      ",".join(stats.running_lora_adapters), str(e))
            if self._lora_labels[e] not in (None, labels):
                self._lora_info.remove(*self._lora_labels[e])  # one series per engine, the latest
            self._lora_info.labels(*labels).set_to_current_time()
            self._lora_labels[e] = labels

    # ---- exposition -----------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

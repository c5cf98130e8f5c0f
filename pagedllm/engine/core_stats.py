"""The engine core's counters and gauges: what /metrics, the dashboard and `kv_cache_stats`
read. Kept apart from the step so that the step only reports (`on_step`, `observe_kv_usage`)."""

from __future__ import annotations

import collections
from typing import Any

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.core_messages import CoreStats
from pagedllm.engine.kv_stats import KVCacheStats, KVCacheStatsTracker
from pagedllm.engine.speculation import Speculation
from pagedllm.lora.core_registry import CoreLoRAs


class CoreCounters:
    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, max_loras: int, loras: CoreLoRAs | None,
                 speculation: Speculation | None) -> None:
        self.scheduler, self.kv, self.max_loras = scheduler, kv, max_loras
        self.loras, self.speculation = loras, speculation
        self.num_steps = 0
        self.num_batched_tokens_total = 0  # tokens fed to the model, cumulative (the dashboard)
        # Tokens fed per step until stats() hands them on; bounded: the offline engine never
        # reads them.
        self._step_tokens: collections.deque[int] = collections.deque(maxlen=4096)
        self._kv_stats = KVCacheStatsTracker(kv.num_blocks, kv.block_size)

    def on_step(self, num_batched_tokens: int) -> None:
        self.num_steps += 1
        self._step_tokens.append(num_batched_tokens)
        self.num_batched_tokens_total += num_batched_tokens

    def observe_kv_usage(self) -> None:
        kv = self.kv
        shared = kv.num_shared_blocks
        # One addition per running sequence; blocks walked only where they are shared.
        tokens = KVCacheStatsTracker.stored_tokens(self.scheduler.running, kv.req_to_blocks, kv.block_size, shared)
        self._kv_stats.observe(kv.num_usable_blocks - kv.num_free_blocks, tokens, shared)

    def stats(self) -> CoreStats:
        """The gauges and counters that /metrics shows (metrics.EngineMetrics)."""
        sched, kv = self.scheduler, self.kv
        step_tokens = list(self._step_tokens)  # each step counted once
        self._step_tokens.clear()
        return CoreStats(
            num_running=len({s.request_id for s in sched.running}),
            num_waiting=len({s.request_id for s in sched.waiting}),
            num_swapped=len({s.request_id for g in sched.swapped for s in g}),
            kv_used_blocks=kv.num_usable_blocks - kv.num_free_blocks,  # not the null block
            kv_num_blocks=kv.num_usable_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=sched.num_preemptions,
            num_steps=self.num_steps,
            kv_used_blocks_by_group=kv.num_used_blocks_by_group if kv.is_hybrid else [],
            sliding_blocks_freed=kv.num_dead_blocks_freed,
            iteration_tokens=step_tokens,
            **self._encoder_cache_fields(),
            **(self.speculation.stats_fields() if self.speculation is not None else {}),
            **self._lora_fields(),
        )

    def _encoder_cache_fields(self) -> dict[str, Any]:
        enc = self.scheduler.encoder_cache
        if not enc.queries and not enc.used:
            return {}
        return dict(mm_cache_queries=enc.queries, mm_cache_hits=enc.hits, mm_images_encoded=enc.images_encoded,
                    mm_rows_encoded=enc.rows_encoded, encoder_cache_rows=enc.used,
                    encoder_cache_capacity=enc.capacity)

    def _lora_fields(self) -> dict[str, Any]:
        """vllm:lora_requests_info's labels: the adapters of running and of waiting requests."""
        if self.loras is None:
            return {}
        sched = self.scheduler
        return dict(max_lora=self.max_loras,
                    running_lora_adapters=self.loras.names_of(s.lora_int_id for s in sched.running),
                    waiting_lora_adapters=self.loras.names_of(
                        s.lora_int_id for s in [*sched.waiting, *(t for g in sched.swapped for t in g)]))

    def kv_cache_stats(self) -> KVCacheStats:
        kv = self.kv
        stats = self._kv_stats.snapshot(self.scheduler.num_preemptions, kv.prefix_cache_queries,
                                        kv.prefix_cache_hits, kv.num_swapped_out, kv.num_swapped_in)
        stats.num_kv_cache_groups = len(kv.groups)
        stats.used_blocks_by_group = kv.num_used_blocks_by_group
        stats.sliding_blocks_freed = kv.num_dead_blocks_freed
        return stats

    def reset_kv_cache_peak(self) -> None:
        self._kv_stats.reset_peak()

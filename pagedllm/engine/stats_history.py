"""The last minutes of each engine core's gauges and counters, for the dashboard's charts.

Fed by the front end with every `CoreStats` a core already sends after its steps (the same
stream as /metrics and the periodic stat line: nothing new is asked of the core), kept as one
sample per `interval_s` per core in a ring of `span_s`. A page that opens late draws the
minutes before it from here (`GET /v1/internal/engine_state?history=1`), then goes on from its
own polls. Cumulative figures stay cumulative; the page takes differences.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from pagedllm.engine.core_messages import CoreStats


class StatsHistory:
    def __init__(self, interval_s: float = 1.0, span_s: float = 300.0) -> None:
        self.interval_s = interval_s
        self.maxlen = max(1, int(span_s / interval_s))
        self._samples: dict[int, collections.deque[dict[str, Any]]] = {}
        self._last: dict[int, float] = {}
        self._batched: dict[int, int] = {}  # tokens fed to the model, cumulative per core

    def observe(self, stats: CoreStats, engine: int = 0, now: float | None = None,
                generation_tokens: Callable[[], float | None] | None = None) -> bool:
        """Count the step tokens of every stats message; keep a sample at most once per
        `interval_s` (`generation_tokens`, read only then: the front end's counter). Returns
        whether a sample was kept."""
        now = time.time() if now is None else now
        self._batched[engine] = self._batched.get(engine, 0) + sum(stats.iteration_tokens)
        if now - self._last.get(engine, float("-inf")) < self.interval_s:
            return False
        self._last[engine] = now
        ring = self._samples.setdefault(engine, collections.deque(maxlen=self.maxlen))
        ring.append({
            "t": now,
            "kv_used_blocks": stats.kv_used_blocks,
            "kv_num_blocks": stats.kv_num_blocks,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_swapped": stats.num_swapped,
            "num_preemptions": stats.num_preemptions,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "num_batched_tokens_total": self._batched[engine],
            "generation_tokens_total": generation_tokens() if generation_tokens else None,
        })
        return True

    def samples(self, engine: int) -> list[dict[str, Any]]:
        return list(self._samples.get(engine, ()))

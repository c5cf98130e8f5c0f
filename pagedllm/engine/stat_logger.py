"""The periodic log line of a server, as vLLM's LoggingStatLogger writes it: throughput,
queues, KV cache usage and prefix-cache hit rate per engine core, and with speculative
decoding the acceptance figures (vLLM's "SpecDecoding metrics" line), every `interval_s`."""

from __future__ import annotations

import logging
import time

from pagedllm.engine.core_messages import CoreStats

logger = logging.getLogger("pagedllm.stats")


class PeriodicStatLogger:
    """Fed every CoreStats a core sends; logs at most once per `interval_s` per core, the
    figures since its previous line."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last: dict[int, tuple[float, CoreStats]] = {}
        self._tokens: dict[int, int] = {}

    def observe(self, stats: CoreStats, engine: int = 0, now: float | None = None) -> str | None:
        """The line logged now, if any (returned for the tests)."""
        now = time.monotonic() if now is None else now
        self._tokens[engine] = self._tokens.get(engine, 0) + sum(stats.iteration_tokens)
        prev = self._last.get(engine)
        if prev is None:
            self._last[engine] = (now, stats)
            self._tokens[engine] = 0
            return None
        t0, before = prev
        elapsed = now - t0
        if elapsed < self.interval_s:
            return None
        tokens, self._tokens[engine] = self._tokens[engine], 0
        self._last[engine] = (now, stats)
        queries = stats.prefix_cache_queries - before.prefix_cache_queries
        hits = stats.prefix_cache_hits - before.prefix_cache_hits
        usage = stats.kv_used_blocks / stats.kv_num_blocks if stats.kv_num_blocks else 0.0
        line = (f"Engine {engine:03d}: Avg throughput: {tokens / elapsed:.1f} tokens/s, Running: "
                f"{stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, Swapped: {stats.num_swapped} reqs, "
                f"KV cache usage: {100 * usage:.1f}%, Prefix cache hit rate: "
                f"{100 * hits / queries if queries else 0.0:.1f}%")
        if stats.spec_accepted_per_pos:
            drafts = stats.spec_num_drafts - before.spec_num_drafts
            drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
            accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
            old = before.spec_accepted_per_pos or [0] * len(stats.spec_accepted_per_pos)
            per_pos = [(a - b) / drafts if drafts else 0.0 for a, b in zip(stats.spec_accepted_per_pos, old)]
            line += (f"; SpecDecoding metrics: Mean acceptance length: "
                     f"{1 + accepted / drafts if drafts else 0.0:.2f}, Accepted: {accepted} tokens, "
                     f"Drafted: {drafted} tokens, Per-position acceptance rate: "
                     f"{', '.join(f'{r:.3f}' for r in per_pos)}, Avg Draft acceptance rate: "
                     f"{100 * accepted / drafted if drafted else 0.0:.1f}%")
        logger.info(line)
        return line

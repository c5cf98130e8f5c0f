"""One engine per configuration per test run: `SharedEngines.get(**config)` builds `LLM(**config)`
the first time a configuration is asked for and hands the same engine to every later test that
asks for it (the `shared_llm` fixture of tests/conftest.py). Tests that only read an engine's
behaviour (its outputs, its counters as differences) use it; a test that kills, corrupts or
reconfigures an engine builds its own. The registry holds at most `capacity` engines (the least
recently used is let go, not shut down: a fixture may still hold it), so that a run's memory
stays bounded."""

from __future__ import annotations

import collections
from typing import Any


def _key(config: dict[str, Any]) -> tuple:
    return tuple(sorted((name, repr(value)) for name, value in config.items()))


class SharedEngines:
    def __init__(self, capacity: int = 3) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._engines: collections.OrderedDict[tuple, Any] = collections.OrderedDict()

    def get(self, **config: Any):
        """The engine of `config` (LLM keyword arguments; `model` too), built on first use."""
        from pagedllm import LLM

        key = _key(config)
        if key in self._engines:
            self._engines.move_to_end(key)
            return self._engines[key]
        while len(self._engines) >= self.capacity:
            self._engines.popitem(last=False)
        llm = LLM(**config)
        self._engines[key] = llm
        return llm

    def close(self) -> None:
        while self._engines:
            _, llm = self._engines.popitem(last=False)
            llm.shutdown()

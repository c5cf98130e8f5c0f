"""One engine per configuration per test run: `SharedEngines.get(**config)` builds `LLM(**config)`
the first time a configuration is asked for and hands the same engine to every later test that
asks for it (the `shared_llm` fixture of tests/conftest.py, session scope). Tests that only read an
engine's behaviour (its outputs, its counters as differences) use it; a test that kills, corrupts
or reconfigures an engine builds its own, and says why.

The registry holds at most `capacity` engines besides the pinned ones (`get(pin=True, ...)`: the
default SmolLM2 engine, which session fixtures hold for the whole run). Past that the least
recently used one is shut down, so that a run's memory and processes stay bounded: a test must
therefore ask `shared_llm(...)` for an unpinned engine where it uses it (a test or a
function-scoped fixture), never keep one in a module- or session-scoped fixture. Every engine is
shut down at the end of the run."""

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
        self._pinned: dict[tuple, Any] = {}

    def get(self, pin: bool = False, **config: Any):
        """The engine of `config` (LLM keyword arguments; `model` too), built on first use;
        `pin=True` keeps it until the end of the run."""
        from pagedllm import LLM

        key = _key(config)
        if key in self._pinned:
            return self._pinned[key]
        if key in self._engines:
            self._engines.move_to_end(key)
            llm = self._engines[key]
            if pin:
                self._pinned[key] = self._engines.pop(key)
            return llm
        if not pin:
            while len(self._engines) >= self.capacity:
                _, evicted = self._engines.popitem(last=False)
                evicted.shutdown()
        llm = LLM(**config)
        (self._pinned if pin else self._engines)[key] = llm
        return llm

    def close(self) -> None:
        for engines in (self._engines, self._pinned):
            while engines:
                _, llm = engines.popitem()
                llm.shutdown()

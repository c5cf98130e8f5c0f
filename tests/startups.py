"""Counts of the expensive things a test run starts: engines built in the pytest process
(every `EngineCore`, whether under `LLM`, `LLMEngine` or an in-process async engine) and
`pagedllm serve` processes started by the server tests. The root conftest prints them at the end
of a run, so that a change to the suite shows what it costs (docs/testing.md)."""

from __future__ import annotations

import collections
import functools

counts: collections.Counter[str] = collections.Counter()
# nodeid -> seconds of set-up, call and teardown: the root conftest prints the slowest.
test_seconds: collections.defaultdict[str, float] = collections.defaultdict(float)


def record(kind: str) -> None:
    counts[kind] += 1


def count_engine_cores() -> None:
    """Wrap `EngineCore.__init__` so each construction in this process is counted."""
    from pagedllm.engine.core import EngineCore

    if getattr(EngineCore.__init__, "_counted", False):
        return
    original = EngineCore.__init__

    @functools.wraps(original)
    def counted(self, *args, **kwargs):
        record("engine cores built in the pytest process")
        return original(self, *args, **kwargs)

    counted._counted = True  # type: ignore[attr-defined]
    EngineCore.__init__ = counted  # type: ignore[method-assign]

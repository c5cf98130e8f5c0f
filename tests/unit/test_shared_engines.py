"""The test run's engine registry (tests/shared_engines.py): one engine per configuration, the
least recently used unpinned one shut down past the capacity, pinned ones kept, all shut down at
the end."""

from __future__ import annotations

import pytest

import pagedllm
from tests.shared_engines import SharedEngines


class FakeLLM:
    built: list[FakeLLM] = []

    def __init__(self, **config):
        self.config, self.closed = config, False
        FakeLLM.built.append(self)

    def shutdown(self):
        assert not self.closed, "shut down twice"
        self.closed = True


@pytest.fixture
def engines(monkeypatch):
    FakeLLM.built = []
    monkeypatch.setattr(pagedllm, "LLM", FakeLLM)
    return SharedEngines(capacity=2)


def test_one_engine_per_configuration(engines):
    a = engines.get(model="m", kv_cache_space=1.0)
    assert engines.get(kv_cache_space=1.0, model="m") is a
    assert engines.get(model="m", kv_cache_space=0.5) is not a
    assert len(FakeLLM.built) == 2


def test_the_least_recently_used_is_shut_down_and_pinned_ones_stay(engines):
    pinned = engines.get(pin=True, model="default")
    a, b = engines.get(model="a"), engines.get(model="b")
    assert engines.get(model="a") is a  # a is now the most recently used
    c = engines.get(model="c")
    assert b.closed and not a.closed and not c.closed and not pinned.closed
    assert engines.get(model="default") is pinned
    assert engines.get(model="b") is not b  # built anew after its eviction
    engines.close()
    assert all(llm.closed for llm in FakeLLM.built)


def test_pinning_an_engine_already_shared_keeps_it(engines):
    a = engines.get(model="a")
    assert engines.get(pin=True, model="a") is a
    engines.get(model="b"), engines.get(model="c"), engines.get(model="d")
    assert not a.closed


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        SharedEngines(capacity=0)

"""The /v1/responses store: both bounds hold over 10,000 responses (memory measured with
tracemalloc), least recently used first out, owners apart, ids unguessable."""

from __future__ import annotations

import tracemalloc

import pytest

from pagedllm.entrypoints.openai.response_store import ResponseStore, new_response_id, owner_of


def _response(i: int) -> dict:
    return {"id": new_response_id(), "object": "response", "status": "completed",
            "output": [{"type": "message", "content": [{"type": "output_text",
                                                         "text": f"answer {i} " * 40}]}]}


@pytest.mark.slow  # 10,000 responses under tracemalloc: 3 s
def test_bounds_hold_over_10000_responses():
    store = ResponseStore(max_entries=100_000, max_bytes=1_000_000)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(10_000):
        assert store.put("a", _response(i), [{"role": "user", "content": f"q {i}"}])
        assert store.bytes <= store.max_bytes
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert store.evicted > 0 and len(store) + store.evicted == 10_000
    # Python objects cost more than their JSON: a few times the byte bound, not 10,000 entries
    assert held < 8 * store.max_bytes, held
    by_entries = ResponseStore(max_entries=50)
    for i in range(10_000):
        by_entries.put(None, _response(i), [])
    assert len(by_entries) == 50


def test_lru_owner_and_delete():
    store = ResponseStore(max_entries=2)
    a, b, c = _response(0), _response(1), _response(2)
    store.put("k1", a, [])
    store.put("k1", b, [])
    assert store.get(a["id"], "k1") is not None  # a used: b is the least recent
    store.put("k1", c, [])
    assert store.get(b["id"], "k1") is None and store.get(a["id"], "k1") is not None
    assert store.get(a["id"], "k2") is None and not store.delete(a["id"], "k2")
    assert store.delete(a["id"], "k1") and store.get(a["id"], "k1") is None
    tiny = ResponseStore(max_bytes=50)
    assert not tiny.put(None, _response(3), []) and len(tiny) == 0


def test_ids_and_owners():
    ids = {new_response_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("resp_") and len(i) == 53 for i in ids)
    assert owner_of("Bearer k", keyed=False) is None
    assert owner_of("Bearer k", keyed=True) != owner_of("Bearer j", keyed=True)
    assert owner_of("Bearer k", keyed=True) == owner_of("Bearer k", keyed=True)
    assert "Bearer" not in owner_of("Bearer k", keyed=True)  # a digest, not the key
    with pytest.raises(ValueError, match="max-entries"):
        ResponseStore(max_entries=0)

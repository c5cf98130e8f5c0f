"""The engine-state snapshot (issue 29) agrees with `kv_cache_stats()` and the pool at every step
of a run with sharing (n = 2 forks, copy-on-write), a prefix hit and preemption (by recompute
and by swap), and names the exact blocks on a tiny pool (10 blocks of 16 tokens, LRU order) of a tiny random Llama."""

from __future__ import annotations

from collections import Counter

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_snapshot import BLOCK_STATES, rle_decode, rle_encode
from tests.integration.model_fixtures import save_tiny_llama

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

PROMPT_A = list(range(1000, 1040))  # 40 tokens: blocks of 16, 16, 8
PROMPT_B = PROMPT_A[:32] + list(range(2000, 2008))  # shares A's two full blocks
PROMPT_C = list(range(3000, 3060))  # 60 tokens: 4 blocks


@pytest.fixture(scope="module")
def llm(tmp_path_factory, smollm2_gguf):
    # a tiny random Llama (2 layers, 2 KV heads of 16): steps take milliseconds
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path, smollm2_gguf)
    return LLM(str(path), num_kv_blocks=10, block_size=16, swap_space=0.05,
               max_model_len=512, enable_prefix_caching=True)


def tables_of(snap: dict, rid: str) -> list[list[int]]:
    req = next(r for r in snap["requests"] if r["id"] == rid)
    return [s["block_tables"][0] for s in req["seqs"]]


def check_agrees(llm: LLM, snap: dict) -> None:
    """Counts equal kv_cache_stats(); each block's state and references equal the pool's."""
    stats = llm.kv_cache_stats()
    kv = llm.llm_engine.kv_cache_manager
    counts = snap["blocks"]["counts"]
    assert counts["used"] + counts["shared"] == stats.used_blocks == snap["counters"]["kv_used_blocks"]
    assert counts["shared"] == stats.shared_blocks == snap["counters"]["kv_shared_blocks"]
    assert snap["counters"]["num_preemptions"] == stats.num_preemptions
    assert snap["counters"]["prefix_cache_hits"] == stats.prefix_cache_hits
    assert snap["counters"]["prefix_cache_queries"] == stats.prefix_cache_queries
    states = rle_decode(snap["blocks"]["rle"])
    assert len(states) == kv.num_blocks
    refs = Counter(b for r in snap["requests"] for s in r["seqs"] if not s["on_host"]
                   for t in s["block_tables"] for b in t)
    for block in kv.block_pool.blocks:
        assert refs[block.block_id] == block.ref_count, block
        expected = ("shared" if block.ref_count > 1 else "used" if block.ref_count else
                    "cached" if block.block_hash is not None else "free")
        assert BLOCK_STATES[states[block.block_id]] == expected, block
    host = rle_decode(snap["host_blocks"]["rle"])
    assert host.count(BLOCK_STATES.index("swapped")) == kv.host_pool.num_used_blocks
    assert snap["counters"]["num_swapped"] == len(snap["queues"]["swapped"])


def test_rle_round_trip():
    for data in (b"", b"\x00", b"\x01\x01\x01\x00\x02\x02", bytes(range(6)) * 3, bytes(5000)):
        assert rle_decode(rle_encode(data)) == bytearray(data)
    assert rle_encode(b"\x00" * 4 + b"\x01" * 2) == [0, 4, 1, 2]


def test_snapshot_matches_stats_through_sharing_prefix_hit_and_preemption(llm):
    eng = llm.llm_engine
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=32, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    eng.add_request("a", PROMPT_A, sampled)
    snap = llm.engine_state()
    assert snap["queues"] == {"running": [], "waiting": ["a"], "swapped": []}
    assert snap["blocks"]["rle"] == [0, 10]  # all free
    check_agrees(llm, snap)

    eng.step()  # prefill of 40 tokens into blocks 0, 1, 2; the first sample forks the child
    snap = llm.engine_state()
    assert tables_of(snap, "a") == [[0, 1, 2], [0, 1, 2]]
    assert snap["blocks"]["rle"] == [2, 3, 0, 7]  # three shared blocks, seven free
    check_agrees(llm, snap)

    eng.step()  # both write position 40 in shared block 2: sample 0 copies it into block 3
    snap = llm.engine_state()
    assert tables_of(snap, "a") == [[0, 1, 3], [0, 1, 2]]
    assert snap["blocks"]["rle"] == [2, 2, 1, 2, 0, 6]
    check_agrees(llm, snap)

    eng.add_request("b", PROMPT_B, greedy)  # hits a's two full blocks
    eng.step()
    snap = llm.engine_state()
    b = next(r for r in snap["requests"] if r["id"] == "b")
    assert b["num_cached_tokens"] == 32 and b["seqs"][0]["block_tables"] == [[0, 1, 4]]
    assert snap["counters"]["prefix_cache_hits"] == 32
    assert snap["blocks"]["rle"][:2] == [2, 2]  # blocks 0, 1: held by a's two samples and b
    check_agrees(llm, snap)

    eng.add_request("c", PROMPT_C, greedy)
    # the newest request, a forked group: the victim once blocks run out, swapped out whole
    eng.add_request("d", PROMPT_C[:8], SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=24,
                                                     ignore_eos=True))
    seen_waiting_preempted = seen_swapped = False
    while eng.has_unfinished_requests():
        eng.step()
        snap = llm.engine_state()
        check_agrees(llm, snap)
        for req in snap["requests"]:
            if req["state"] == "waiting" and req["num_preemptions"]:
                seen_waiting_preempted = True
            if req["state"] == "swapped":
                seen_swapped = True
                assert req["num_host_blocks"] > 0 and req["num_blocks"] == 0
                assert all(s["on_host"] for s in req["seqs"])
    # d (a forked group) was swapped out, c (single) recomputed
    assert seen_waiting_preempted and seen_swapped
    snap = llm.engine_state()
    assert snap["requests"] == [] and snap["counters"]["kv_used_blocks"] == 0
    counts = snap["blocks"]["counts"]
    assert counts["used"] == counts["shared"] == 0 and counts["cached"] > 0  # prefixes stay
    check_agrees(llm, snap)
    assert snap["config"]["num_blocks"] == 10 and snap["config"]["block_size"] == 16
    # 2 (K, V) x 2 layers x 16 tokens x 2 KV heads x 16 (head_dim) x 4 bytes (float32)
    assert snap["config"]["bytes_per_block"] == 2 * 2 * 16 * 2 * 16 * 4


def test_snapshot_carries_request_timings(llm):
    eng = llm.llm_engine
    eng.add_request("t", PROMPT_C[:20], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for _ in range(4):
        eng.step()
    req = next(r for r in llm.engine_state()["requests"] if r["id"] == "t")
    assert req["request_id"] == "t" and req["ttft_s"] > 0 and req["itl_s"] > 0
    assert req["num_output_tokens"] == 4 and req["num_prompt_tokens"] == 20
    while eng.has_unfinished_requests():
        eng.step()

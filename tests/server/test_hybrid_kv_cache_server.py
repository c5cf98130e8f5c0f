"""The hybrid KV cache through a real `pagedllm serve` (engine core in its own process) on a
tiny Gemma 3 checkpoint (layers sliding, sliding, full, sliding; window 8; chunks of 32 tokens): the start-up log
names the groups, /metrics shows each group's blocks and the blocks the windows gave back,
long requests (prompt and output far past the window) finish with the pool empty again,
hostile values are 400s that lose nothing, and a plain request succeeds afterwards."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from transformers import Gemma3TextConfig

from tests.integration.arch_parity import build_tiny
from tests.server.conftest import serving
from tests.server.helpers import read_metrics

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

NAME = "tiny-gemma3"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-served")
    config = Gemma3TextConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                              max_position_embeddings=MAX_MODEL_LEN, sliding_window=8, sliding_window_pattern=3)
    build_tiny(config, path)
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", str(path), "--served-model-name", NAME,
                  "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "64", "--block-size", "8",
                  "--max-num-batched-tokens", "32"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(gemma_server):
    import httpx

    with httpx.Client(base_url=gemma_server.url, headers=gemma_server.headers, timeout=120.0) as c:
        yield c


def _value(m: dict, name: str, **labels: str) -> float:
    return m[(name, tuple(sorted({"model_name": NAME, "engine": "0", **labels}.items())))]


def _groups(m: dict) -> dict[tuple[str, str], float]:
    """(group index, attention) -> blocks held, from pagedllm:kv_cache_group_used_blocks."""
    out = {}
    for (name, labels), v in m.items():
        if name == "pagedllm:kv_cache_group_used_blocks":
            d = dict(labels)
            out[(d["kv_cache_group"], d["attention"])] = v
    return out


def _wait_empty(http, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(http)
        if (_value(m, "pagedllm:kv_cache_used_blocks") == 0 and not any(_groups(m).values())) \
                or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def _prompt(n: int, start: int = 3) -> str:
    return " ".join(f"t{start + i % 900}" for i in range(n))


def _complete(http, **body):
    return http.post("/v1/completions", json={"model": NAME, **body})


def test_start_up_log_names_the_groups(gemma_server):
    log = gemma_server.log_tail(200_000)
    assert "KV cache groups: 4, of 1 layer(s) each (full, window 8, window 8, window 8)" in log, log[-3000:]


def test_metrics_show_each_group_and_the_blocks_windows_gave_back(http):
    m = _wait_empty(http)
    # 1 full layer and 3 sliding ones: four groups of one layer each
    assert set(_groups(m)) == {("0", "full")} | {(str(g), "sliding_window=8") for g in (1, 2, 3)}
    freed_before = _value(m, "pagedllm:kv_cache_sliding_blocks_freed_total")
    prompts = [_prompt(60 + 17 * i, start=3 + 50 * i) for i in range(4)]
    peak: dict = {}

    def watch():  # the gauges while the long requests run
        while not done:
            for key, v in _groups(read_metrics(http)).items():
                peak[key] = max(peak.get(key, 0), v)
            time.sleep(0.05)

    done = False
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        watcher = pool.submit(watch)
        results = list(pool.map(lambda p: _complete(http, prompt=p, max_tokens=80, ignore_eos=True,
                                                     temperature=0), prompts))
        done = True
        watcher.result()
    for r in results:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 80
    m = _wait_empty(http)
    assert _value(m, "pagedllm:kv_cache_sliding_blocks_freed_total") > freed_before
    sliding = [peak[(str(g), "sliding_window=8")] for g in (1, 2, 3)]
    assert peak[("0", "full")] > 0 and min(sliding) > 0
    # a decoding sequence's sliding table holds ceil((B + W - 2 + 1) / B) = 2 blocks at most,
    # its full table up to 18 (a prefill chunk's sliding blocks die after its step)
    assert max(sliding) < peak[("0", "full")]
    assert _value(m, "pagedllm:kv_cache_used_blocks") == 0 and not any(_groups(m).values())


@pytest.mark.parametrize("body, field", [
    (dict(prompt=_prompt(MAX_MODEL_LEN + 5), max_tokens=1), "maximum context length"),
    (dict(prompt="t5 t6", max_tokens=MAX_MODEL_LEN * 100), "in the completion"),
    (dict(prompt="t5 t6", max_tokens=4, min_tokens=MAX_MODEL_LEN * 10), "min_tokens"),
    (dict(prompt="t5 t6", max_tokens=4, n=10_000), "n"),
    (dict(prompt="t5 t6", max_tokens=4, best_of=10**9, n=1), "best_of"),
])
def test_hostile_values_are_400s_and_a_plain_request_still_runs(http, body, field):
    r = _complete(http, **body)
    assert r.status_code == 400, r.text
    assert field in r.text, r.text
    m = _wait_empty(http)
    assert _value(m, "pagedllm:kv_cache_used_blocks") == 0
    ok = _complete(http, prompt=_prompt(40), max_tokens=30, ignore_eos=True, temperature=0)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 30


def test_a_repeated_long_prompt_hits_the_prefix_cache_and_answers_the_same(http):
    prompt = _prompt(120, start=400)
    first = _complete(http, prompt=prompt, max_tokens=20, temperature=0)
    hits_before = _value(read_metrics(http), "vllm:prefix_cache_hits_total")
    second = _complete(http, prompt=prompt, max_tokens=20, temperature=0)
    assert first.status_code == second.status_code == 200
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert _value(read_metrics(http), "vllm:prefix_cache_hits_total") > hits_before


def test_streaming_past_the_window_then_a_plain_request(http):
    with http.stream("POST", "/v1/completions", json={
            "model": NAME, "prompt": _prompt(50), "max_tokens": 60, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        chunks = [line for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(chunks) >= 2
    ok = _complete(http, prompt="t7 t8 t9", max_tokens=5)
    assert ok.status_code == 200, ok.text
    _wait_empty(http)


def test_engine_state_names_each_blocks_group(http):
    """The dashboard's snapshot of a hybrid pool: one group per block, as the tables say."""
    from pagedllm.core.kv_snapshot import BLOCK_STATES, NO_GROUP, rle_decode

    seen_used = False
    with http.stream("POST", "/v1/completions", json={
            "model": NAME, "prompt": _prompt(60), "max_tokens": 40, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            snap = http.get("/v1/internal/engine_state").json()["engines"][0]
            assert snap["config"]["kv_cache_groups"] == ["full"] + ["sliding_window=8"] * 3
            n = snap["config"]["num_blocks"]
            states, groups = rle_decode(snap["blocks"]["rle"]), rle_decode(snap["blocks"]["groups_rle"])
            assert len(states) == len(groups) == n
            assert states.count(BLOCK_STATES.index("reserved")) == 1  # the null block
            owner = {b: g for req in snap["requests"] for s in req["seqs"] if not s["on_host"]
                     for g, table in enumerate(s["block_tables"]) for b in table if b >= 0}
            for b in range(n):
                held = BLOCK_STATES[states[b]] in ("used", "shared")
                assert held == (b in owner), b
                assert groups[b] == (owner[b] if held else NO_GROUP), b
            seen_used = seen_used or bool(owner)
    assert seen_used
    _wait_empty(http)

"""Many streams at once, and clients that leave: their requests are aborted, their KV blocks
return to the pool, and the next request is served."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server.helpers import MODEL, metric, read_metrics, wait_idle

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier


def test_32_concurrent_streams_finish_with_the_right_lengths(server, http):
    before = wait_idle(http)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str, str]:
        max_tokens = 4 + i % 8
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request {i}: count to ten.", max_tokens=max_tokens,
            temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, finish, usage = "", None, None
        async for chunk in stream:
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
            usage = chunk.usage or usage
        return max_tokens, usage.completion_tokens, finish, text

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key,
                                      max_retries=0, timeout=180.0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    for max_tokens, completion_tokens, finish, text in results:
        assert (completion_tokens, finish) == (max_tokens, "length")
        assert text
    after = wait_idle(http)
    expected_tokens = sum(r[0] for r in results)
    assert metric(after, "vllm:generation_tokens_total") - \
        metric(before, "vllm:generation_tokens_total") == expected_tokens
    assert metric(after, "vllm:request_success_total", finished_reason="length") - \
        metric(before, "vllm:request_success_total", finished_reason="length") == 32


LONG = {"model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": 1900,
        "temperature": 0, "ignore_eos": True}


def _aborts(m: dict) -> float:
    return metric(m, "vllm:request_success_total", finished_reason="abort")


async def _cancel_once_running(http, task: asyncio.Task, poll_s: float) -> None:
    """Cancel `task` (its connection drops) as soon as the server reports a request running:
    no timing is assumed, so a faster machine cannot finish the request first."""
    deadline = time.monotonic() + 60
    while metric(read_metrics(http), "vllm:num_requests_running") < 1:
        assert not task.done(), task.result()
        assert time.monotonic() < deadline, "the request never started running"
        await asyncio.sleep(poll_s)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def test_stream_disconnect_aborts_the_request(server, http, client):
    before = wait_idle(http)
    t0 = time.monotonic()
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60.0) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events += 1
                if events == 3:
                    break
        # leaving both blocks closes the connection mid-stream
    m = read_metrics(http)
    assert metric(m, "vllm:num_requests_running") + \
        metric(m, "vllm:num_requests_waiting") <= 1
    after = wait_idle(http, timeout=30.0)
    elapsed = time.monotonic() - t0
    assert metric(after, "pagedllm:kv_cache_used_blocks") == 0
    assert metric(after, "vllm:num_requests_running") == 0
    assert _aborts(after) - _aborts(before) == 1
    generated = metric(after, "vllm:generation_tokens_total") - \
        metric(before, "vllm:generation_tokens_total")
    # Aborted (counted above), so it stopped before max_tokens whatever the machine's speed.
    assert 3 <= generated < LONG["max_tokens"], (generated, elapsed)
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_non_stream_disconnect_aborts_the_request(server, http, client):
    """A client that gives up on a non-streamed request (its task is cancelled once the request
    runs: httpx drops the connection) cancels the handler, which aborts the engine request.
    No timing is assumed: the client leaves as soon as the server reports the request running."""
    before = wait_idle(http)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers,
                                     timeout=120.0) as c:
            task = asyncio.create_task(c.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": LONG["max_tokens"], "temperature": 0, "ignore_eos": True}))
            await _cancel_once_running(http, task, 0.02)

    asyncio.run(main())
    after = wait_idle(http, timeout=30.0)
    assert metric(after, "pagedllm:kv_cache_used_blocks") == 0
    assert _aborts(after) - _aborts(before) == 1
    generated = metric(after, "vllm:generation_tokens_total") - \
        metric(before, "vllm:generation_tokens_total")
    assert generated < LONG["max_tokens"]
    out = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                         messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content is not None


def test_async_client_cancelled_task_aborts(server, http):
    """An asyncio task awaiting a stream is cancelled (as a web app does when its own client
    leaves): the server sees the disconnect and aborts."""
    before = wait_idle(http)

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key,
                                      max_retries=0) as client:
            async def consume():
                body = {k: v for k, v in LONG.items() if k != "ignore_eos"}
                stream = await client.completions.create(stream=True, **body,
                                                         extra_body={"ignore_eos": True})
                async for _ in stream:
                    pass

            task = asyncio.create_task(consume())
            await _cancel_once_running(http, task, 0.05)

    asyncio.run(main())
    after = wait_idle(http, timeout=30.0)
    assert metric(after, "pagedllm:kv_cache_used_blocks") == 0
    assert _aborts(after) - _aborts(before) == 1

"""`cache_salt` (vLLM's request field) keeps tenants' prefix caches apart: requests with the
same salt share prefix hits, requests with another salt (or none) do not. Observed through
/metrics `vllm:prefix_cache_hits_total` (tokens), as differences around each request."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.server.helpers import MODEL, metric, wait_idle

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier


def _long_prompt() -> str:
    """A prompt of a few hundred tokens nobody has sent before (so nothing is cached yet)."""
    tag = uuid.uuid4().hex
    return f"Session {tag}. " + " ".join(f"item {tag[i % 32]}{i}" for i in range(80))


def _hits(http, send) -> float:
    """Prefix-cache hit tokens that `send()` caused."""
    before = metric(wait_idle(http), "vllm:prefix_cache_hits_total")
    send()
    return metric(wait_idle(http), "vllm:prefix_cache_hits_total") - before


def test_completion_cache_salt_isolates_prefixes(http, client):
    prompt = _long_prompt()

    def complete(salt: str | None):
        extra = {"cache_salt": salt} if salt is not None else {}
        return lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                                 temperature=0, extra_body=extra)

    assert _hits(http, complete("alice")) == 0  # first sight of the prompt
    assert _hits(http, complete("bob")) == 0  # another tenant: no hit on alice's blocks
    assert _hits(http, complete(None)) == 0  # unsalted: no hit either
    assert _hits(http, complete("alice")) >= 128  # same salt: alice's prefix is found
    assert _hits(http, complete(None)) >= 128  # the unsalted request's own blocks


def test_chat_cache_salt_isolates_prefixes(http, client):
    messages = [{"role": "system", "content": _long_prompt()},
                {"role": "user", "content": "Say one word."}]

    def chat(salt: str, stream: bool = False):
        def send():
            out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                 temperature=0, stream=stream,
                                                 extra_body={"cache_salt": salt})
            if stream:
                list(out)
        return send

    assert _hits(http, chat("tenant-a")) == 0
    assert _hits(http, chat("tenant-b", stream=True)) == 0
    assert _hits(http, chat("tenant-a", stream=True)) >= 128
    assert _hits(http, chat("tenant-b")) >= 128


@pytest.mark.parametrize("salt", ["", 123, ["a"]])
def test_invalid_cache_salt_is_a_400(http, client, salt):
    for path, body in (
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
        ("/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ):
        r = http.post(path, json={**body, "cache_salt": salt})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == "cache_salt" and "cache_salt" in err["message"], err
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                  extra_body={"cache_salt": salt})

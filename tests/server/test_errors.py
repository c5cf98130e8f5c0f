"""Every error answers in OpenAI's shape with the right status, and the server goes on
serving: each case is followed by a successful request."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.helpers import API_KEY, MAX_MODEL_LEN, MODEL

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier


def assert_error(resp: httpx.Response, status: int, message: str, param: str | None = None):
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert message in err["message"], err["message"]
    assert err["code"] == status
    assert err["type"] == {400: "BadRequestError", 401: "AuthenticationError",
                           404: "NotFoundError"}[status]
    if param is not None:
        assert err["param"] == param


def assert_serving(client) -> None:
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


COMPLETION_400 = [
    ({"temperature": -1}, "temperature must be non-negative", None),
    ({"top_p": 2}, "top_p must be in (0, 1]", None),
    ({"n": 0}, "n must be at least 1", None),
    ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2]", None),
    ({"max_tokens": 0}, "max_tokens must be at least 1", None),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens must be less than or equal", None),
    ({"logprobs": 50}, "less than or equal to 20", "logprobs"),
    ({"logit_bias": {"10000000": 5}}, "out-of-vocab", None),
    ({"logit_bias": {"x": 5}}, "logit_bias keys must be token ids", None),
    ({"stop": [""]}, "stop cannot contain an empty string", None),
    ({"seed": 2**70}, "less than or equal to", "seed"),
    ({"top_k": -5}, "greater than or equal to -1", "top_k"),
    ({"prompt": ""}, "The prompt is empty", None),
    ({"prompt": []}, "prompt must not be empty", "prompt"),
    ({"prompt": [1, 10**9]}, "out of vocabulary", None),
    ({"suffix": "tail"}, "suffix is not supported", "suffix"),
    ({"stream_options": {"include_usage": True}}, "only be defined when `stream=True`", None),
    ({"stream": True, "stream_options": {"include_usage": True}, "temperature": -1},
     "temperature must be non-negative", None),
]


@pytest.mark.parametrize("fields,message,param", COMPLETION_400,
                         ids=[str(f)[:40] for f, _, _ in COMPLETION_400])
def test_completion_invalid_values_are_400(http, client, fields, message, param):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, **fields}
    assert_error(http.post("/v1/completions", json=body), 400, message, param)
    assert_serving(client)


CHAT_400 = [
    ({"top_logprobs": 2}, "`logprobs` must be set to true", None),
    ({"logprobs": True, "top_logprobs": 30}, "less than or equal to 20", "top_logprobs"),
    ({"messages": []}, "at least 1 item", "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "Input should be", "messages"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]},
     "content parts of type 'image_url' are not supported: ", None),  # the model takes text only
    ({"messages": "hi"}, "Input should be a valid list", "messages"),
    ({"temperature": "hot"}, "valid number", "temperature"),
]


@pytest.mark.parametrize("fields,message,param", CHAT_400,
                         ids=[str(f)[:40] for f, _, _ in CHAT_400])
def test_chat_invalid_values_are_400(http, client, fields, message, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            **fields}
    assert_error(http.post("/v1/chat/completions", json=body), 400, message, param)
    assert_serving(client)


def test_prompt_longer_than_the_context_is_400(http, client):
    prompt = [28] * 2000
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 100}
    expected = (f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you "
                f"requested 2100 tokens (2000 in the messages, 100 in the completion).")
    assert_error(http.post("/v1/completions", json=body), 400, expected)
    # The same before a stream starts: a 400, not a 200 with an error inside.
    assert_error(http.post("/v1/completions", json={**body, "stream": True}), 400, expected)
    assert_serving(client)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, max_completion_tokens=2040,
                                       messages=[{"role": "user", "content": "hi"}])
    assert "maximum context length is 2048 tokens" in str(exc.value)
    assert exc.value.status_code == 400
    assert_serving(client)


def test_unknown_model_is_404(http, client):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        resp = http.post(path, json={**body, "model": "gpt-4"})
        assert_error(resp, 404, "The model `gpt-4` does not exist.", "model")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    assert_serving(client)


def test_api_key_is_required(server, client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        resp = httpx.post(f"{server.url}/v1/completions", headers=headers,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert_error(resp, 401, "API key")
        assert_error(httpx.get(f"{server.url}/v1/models", headers=headers), 401, "API key")
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    # health and metrics are open
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert_serving(client)


def test_malformed_bodies_are_400(http, client):
    resp = http.post("/v1/completions", content=b"{not json",
                     headers={"Content-Type": "application/json"})
    assert_error(resp, 400, "JSON")
    assert_error(http.post("/v1/completions", json={"model": MODEL}), 400, "Field required",
                 "prompt")
    assert_error(http.post("/v1/completions", json=[1, 2]), 400, "valid dictionary")
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL}), 400,
                 "Field required", "messages")
    assert_serving(client)


def test_unknown_route_is_404_json(http, client):
    assert_error(http.get("/v1/nothing-here"), 404, "Not Found")
    assert_serving(client)

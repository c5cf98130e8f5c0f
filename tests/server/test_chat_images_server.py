"""/v1/chat/completions with image parts on a `pagedllm serve` of the tiny random LLaVA (issue
45): a data URL and an http URL from an allowed host (a local http.server) give transformers'
greedy tokens; refusals are 400s naming the flag; a slow image URL holds neither the event loop
nor other requests (a text request finishes while it waits). transformers' tokens are stored
(tests/references.py, `chat_images_server.*`)."""

from __future__ import annotations

import base64
import http.server as http_server
import io
import threading
import time

import pytest

from tests.integration.vlm_fixtures import chat_prompt, sample_images, stored_greedy, user_turn
from tests.server.conftest import serving

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
QUESTION = "Describe the image."
IMAGE = sample_images(1, seed=5)[0]


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


PNG = _png(IMAGE)


class _Images(http_server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(4)
        body = PNG if self.path in ("/img.png", "/slow.png") else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def image_host():
    srv = http_server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def vlm_server(tiny_vlm):
    folder = tiny_vlm("llava")
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", folder, "--max-model-len", "512",
                  "--kv-cache-space", "0.05", "--allowed-media-domains", "127.0.0.1",
                  "--media-fetch-timeout", "2", "--limit-mm-per-prompt", '{"image": 1}']) as srv:
        yield srv, folder


@pytest.fixture(scope="module")
def http(vlm_server):
    import httpx

    srv, _ = vlm_server
    with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=60.0) as c:
        yield c


def _body(*parts, **kw) -> dict:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, **kw}


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_urls_match_transformers(vlm_server, http, image_host):
    _, folder = vlm_server
    expected = stored_greedy("chat_images_server.image_urls", folder,
                             [(chat_prompt(folder, user_turn(QUESTION, 1)), [IMAGE])], MAX_TOKENS)[0]
    data_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    for url in (data_url, f"{image_host}/img.png"):
        r = http.post("/v1/chat/completions", json=_body(_image(url)))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected, url


@pytest.mark.parametrize("parts,message", [
    ([_image("http://example.com/a.png")], "host 'example.com' is not in --allowed-media-domains"),
    ([_image("file:///etc/hostname")], "--allowed-local-media-path"),
    ([_image("data:image/png;base64,AAAA"), _image("data:image/png;base64,AAAA")],
     r"At most 1 image\(s\) .*--limit-mm-per-prompt"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
     "'input_audio' are not supported: pagedllm takes text and images"),
    ([_image("data:image/png;base64," + base64.b64encode(b"junk").decode())], "could not be decoded"),
])
def test_refusals_are_400s(http, parts, message):
    import re

    r = http.post("/v1/chat/completions", json=_body(*parts))
    assert r.status_code == 400, r.text
    assert re.search(message, r.json()["error"]["message"]), r.json()


def test_slow_image_url_blocks_no_other_request(http, image_host):
    done: dict[str, float] = {}
    results = {}

    def slow():
        results["slow"] = http.post("/v1/chat/completions", json=_body(_image(f"{image_host}/slow.png")))
        done["slow"] = time.monotonic()

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.3)  # the slow fetch is under way
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2, "temperature": 0})
    done["text"] = time.monotonic()
    t.join(30)
    assert r.status_code == 200, r.text
    assert results["slow"].status_code == 400
    assert "within 2 s (--media-fetch-timeout)" in results["slow"].json()["error"]["message"]
    assert done["text"] < done["slow"]  # served while the image was still being fetched


def test_official_client_streams_an_image_chat_and_the_engine_shows_it(vlm_server):
    """The official client with a data URL, streamed and not: the same tokens as transformers;
    /metrics counts the image (vllm:mm_cache_*), a repeat is an encoder-cache hit or a prefix
    hit, and the dashboard's state shows a running request's image span."""
    import openai

    srv, folder = vlm_server
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=120.0)
    (im,) = sample_images(1, seed=21)
    url = "data:image/png;base64," + base64.b64encode(_png(im)).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": "low"}},
                                             {"type": "text", "text": QUESTION}]}]
    expected = stored_greedy("chat_images_server.official_client", folder,
                             [(chat_prompt(folder, user_turn(QUESTION, 1)), [im])], MAX_TOKENS)[0]
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(folder)
    model = client.models.list().data[0].id
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert plain.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert plain.usage.prompt_tokens > 16  # the 16 image rows are prompt tokens
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == plain.choices[0].message.content
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    metrics = {line.split(" ")[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
               for line in __import__("httpx").get(f"{srv.url}/metrics", headers=srv.headers).text.splitlines()
               if line.startswith(("vllm:mm_cache", "pagedllm:mm_images_encoded", "vllm:prefix_cache_hits"))}
    assert metrics["vllm:mm_cache_queries_total"] >= 1 and metrics["pagedllm:mm_images_encoded_total"] >= 1
    assert metrics["vllm:prefix_cache_hits_total"] > 0  # the second time: the image's blocks were shared


def test_hostile_image_values_are_400s_and_a_plain_request_still_succeeds(http):
    import io

    from PIL import Image

    bomb = io.BytesIO()
    Image.new("1", (5000, 5000)).save(bomb, "PNG")  # 25M pixels over the 16.7M default cap, a few KB
    hostile = [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(bomb.getvalue()).decode()}},
         "pixels"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!not base64!!!"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": ""}}, "url"),
        ({"type": "image_url", "image_url": "not an object"}, "unsupported scheme"),
        ({"type": "video_url", "video_url": {"url": "http://127.0.0.1/v.mp4"}}, "video_url"),
        ({"type": "image_url", "image_url": {"url": "ftp://127.0.0.1/a.png"}}, "ftp"),
    ]
    for part, word in hostile:
        r = http.post("/v1/chat/completions", json=_body(part))
        assert r.status_code == 400, (part, r.text)
        assert word in r.json()["error"]["message"].lower() or word in str(r.json()["error"].get("param")), r.json()
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_responses_take_input_image_parts(vlm_server, http):
    """/v1/responses with an `input_image` part runs the chat path's image handling: the same
    greedy text as chat (and transformers); the input item lists the image; a continuation
    replays it (a prefix-cache hit); hostile image parts are 400s naming the part."""
    import openai

    srv, folder = vlm_server
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key or "EMPTY",
                           max_retries=0, timeout=60.0)
    data_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    chat = http.post("/v1/chat/completions", json=_body(_image(data_url))).json()
    parts = [{"type": "input_image", "image_url": data_url, "detail": "auto"},
             {"type": "input_text", "text": QUESTION}]
    resp = client.responses.create(model=chat["model"], input=[{"role": "user", "content": parts}],
                                   temperature=0, max_output_tokens=MAX_TOKENS)
    assert resp.output_text == chat["choices"][0]["message"]["content"]
    assert resp.usage.input_tokens == chat["usage"]["prompt_tokens"]
    (item,) = client.responses.input_items.list(resp.id).data
    assert [p.type for p in item.content] == ["input_image", "input_text"]
    again = client.responses.create(model=chat["model"], input="Again.", temperature=0,
                                    max_output_tokens=2, previous_response_id=resp.id)
    assert again.usage.input_tokens_details.cached_tokens >= resp.usage.input_tokens - 16
    for bad, param in ((dict(parts[0], file_id="file_1"), "input[0].content[0].file_id"),
                       ({"type": "input_image"}, "input[0].content[0].image_url"),
                       ({"type": "input_image", "image_url": "http://example.com/a.png"}, None)):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=chat["model"], input=[{"role": "user", "content": [bad]}],
                                    max_output_tokens=2)
        if param is not None:
            assert info.value.body["param"] == param
        else:
            assert "--allowed-media-domains" in info.value.body["message"]
    assert http.get("/health").status_code == 200

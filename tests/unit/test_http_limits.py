"""The server's request limits without a model: the body middleware and the head-deadline
protocol on an in-process uvicorn with a toy ASGI app (short timeouts), the prompt-length
bound of in-memory tokenizers, the chat template time limit and trust rule, deep JSON schemas,
and the flags' validation."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time

import httpx
import pytest
import uvicorn

from pagedllm.entrypoints.openai.http_limits import (
    HTTPLimits,
    RequestBodyMiddleware,
    limited_h11_protocol,
)
from tests.server.helpers import free_port

LIMITS = HTTPLimits(max_body_bytes=64 * 1024, header_timeout_s=0.5, body_timeout_s=0.5)


class ToyApp:
    """Answers `{"bytes": n}` with the body's size; /stream sends 3 chunks 0.3 s apart."""

    def __init__(self) -> None:
        self.bodies: list[int] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(len(body))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        if scope["path"] == "/stream":
            for i in range(3):
                await send({"type": "http.response.body", "body": b"%d\n" % i,
                            "more_body": True})
                await asyncio.sleep(0.3)
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.body", "body": json.dumps({"bytes": len(body)}).encode()})


@pytest.fixture(scope="module")
def toy():
    app = ToyApp()
    port = free_port()
    config = uvicorn.Config(RequestBodyMiddleware(app, LIMITS), host="127.0.0.1", port=port,
                            http=limited_h11_protocol(LIMITS), log_level="warning",
                            timeout_keep_alive=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    yield app, f"http://127.0.0.1:{port}", port
    server.should_exit = True
    thread.join(10)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def _read_until_closed(s: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes; (data, seconds it took)."""
    t0 = time.monotonic()
    s.settimeout(timeout)
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk


def _read_response(s: socket.socket, timeout: float) -> bytes:
    """One whole chunked response (the connection stays open): its head and body may come in
    separate segments, and what is left unread would be taken for the next response."""
    s.settimeout(timeout)
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        chunk = s.recv(65536)
        assert chunk, f"the server closed the connection mid-response: {data!r}"
        data += chunk
    return data


# ---- body size and time ---------------------------------------------------------------------


def test_a_body_within_the_limit_reaches_the_app_whole(toy):
    app, url, _ = toy
    r = httpx.post(url, content=b"x" * 50_000)
    assert r.status_code == 200 and r.json() == {"bytes": 50_000}
    chunked = httpx.post(url, content=iter([b"y" * 20_000] * 3))  # Transfer-Encoding: chunked
    assert chunked.status_code == 200 and chunked.json() == {"bytes": 60_000}
    assert httpx.get(url).json() == {"bytes": 0}


def test_content_length_over_the_limit_is_a_413_before_the_body_is_read(toy):
    app, url, _ = toy
    seen = len(app.bodies)
    with httpx.Client(base_url=url) as c:
        t0 = time.monotonic()
        r = c.post("/", content=b"x" * 1_000_000)
        took = time.monotonic() - t0
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == 413 and "1000000 bytes" in err["message"]
        assert "--max-request-body-bytes" in err["message"]
        assert took < 2.0
        assert c.post("/", content=b"ok").json() == {"bytes": 2}  # the connection goes on
    assert len(app.bodies) == seen + 1  # the large one never reached the app


def test_a_chunked_body_is_counted_as_it_comes_and_refused_past_the_limit(toy):
    app, url, _ = toy
    seen = len(app.bodies)
    r = httpx.post(url, content=iter([b"z" * 16_384] * 40))
    assert r.status_code == 413, r.text
    assert f"more than {LIMITS.max_body_bytes} bytes" in r.json()["error"]["message"]
    assert len(app.bodies) == seen


def test_a_slow_body_gets_a_408_and_the_connection_is_closed(toy):
    app, _, port = toy
    seen = len(app.bodies)
    s = _connect(port)
    s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
    data, took = _read_until_closed(s, timeout=5)
    s.close()
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"--request-body-timeout" in data
    assert LIMITS.body_timeout_s - 0.1 < took < LIMITS.body_timeout_s + 1.5
    assert len(app.bodies) == seen


def test_the_rest_of_a_refused_body_is_dropped_for_the_body_timeout_then_closed(toy):
    _, _, port = toy
    s = _connect(port)
    s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n")
    s.settimeout(5)
    assert s.recv(65536).startswith(b"HTTP/1.1 413")
    t0 = time.monotonic()
    with pytest.raises(OSError):  # the server closes while the client keeps sending
        while time.monotonic() - t0 < 5:
            s.sendall(b"x" * 1000)
            time.sleep(0.05)
    assert time.monotonic() - t0 < LIMITS.body_timeout_s + 1.5
    s.close()


# ---- the request head ---------------------------------------------------------------------


def test_slow_heads_are_closed_in_time_and_others_are_served_meanwhile(toy):
    _, url, port = toy
    socks = [_connect(port) for _ in range(20)]
    for s in socks:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")
        s.setblocking(False)
    t0 = time.monotonic()
    closed: dict[int, float] = {}
    served = False
    while len(closed) < len(socks) and time.monotonic() - t0 < 5:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                s.sendall(b"X-Slow: 1\r\n")
                if s.recv(65536).startswith(b"HTTP/1.1 408"):
                    closed[i] = time.monotonic() - t0
            except BlockingIOError:
                pass
            except OSError:
                closed[i] = time.monotonic() - t0
        if not served:
            served = httpx.post(url, content=b"abc").json() == {"bytes": 3}
        time.sleep(0.05)
    for s in socks:
        s.close()
    assert served
    assert len(closed) == len(socks)
    assert max(closed.values()) < LIMITS.header_timeout_s + 1.0


def test_a_connection_that_sends_nothing_is_closed(toy):
    _, _, port = toy
    s = _connect(port)
    data, took = _read_until_closed(s, timeout=5)
    s.close()
    assert data.startswith(b"HTTP/1.1 408") and b"--request-header-timeout" in data
    assert took < LIMITS.header_timeout_s + 1.0


def test_the_next_head_on_a_kept_alive_connection_has_the_deadline_too(toy):
    _, _, port = toy
    s = _connect(port)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    first = _read_response(s, timeout=5)
    assert first.startswith(b"HTTP/1.1 200")
    time.sleep(LIMITS.header_timeout_s + 0.3)  # idle: uvicorn's keep-alive (5 s), not ours
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # a partial second head
    data, took = _read_until_closed(s, timeout=5)
    s.close()
    assert data.startswith(b"HTTP/1.1 408")
    assert took < LIMITS.header_timeout_s + 1.0


def test_streaming_responses_pass_through_unbuffered(toy):
    _, url, _ = toy
    arrivals = []
    with httpx.stream("POST", f"{url}/stream", content=b"q") as r:
        for line in r.iter_lines():
            arrivals.append(time.monotonic())
    assert len(arrivals) == 3
    assert arrivals[-1] - arrivals[0] > 0.45  # each chunk came when it was sent


@pytest.mark.parametrize("kwargs", [{"max_body_bytes": 0}, {"max_body_bytes": -1},
                                    {"header_timeout_s": 0}, {"body_timeout_s": -2.0},
                                    {"body_timeout_s": float("nan")}])
def test_limits_must_be_positive(kwargs):
    with pytest.raises(ValueError, match="must be a positive number"):
        HTTPLimits(**kwargs)


@pytest.mark.parametrize("flag", ["--max-request-body-bytes", "--request-header-timeout",
                                  "--request-body-timeout", "--chat-template-render-timeout"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_server_flags_refuse_zero_and_negative(flag, value):
    from pagedllm.entrypoints.arg_utils import validate_server_args
    from pagedllm.entrypoints.openai.api_server import build_parser

    args = build_parser().parse_args([flag, value])
    with pytest.raises(ValueError, match=f"{flag} must be a positive number"):
        validate_server_args(args)


def test_server_flag_defaults():
    from pagedllm.entrypoints.openai.api_server import build_parser

    args = build_parser().parse_args([])
    assert args.max_request_body_bytes == 8 * 1024 * 1024
    assert (args.request_header_timeout, args.request_body_timeout) == (10.0, 30.0)
    assert args.trust_request_chat_template is False
    assert args.chat_template_render_timeout == 5.0


# ---- prompt length before tokenizing --------------------------------------------------------

CORPUS = ["hello world, hello there", "the quick brown fox jumps over the lazy dog",
          "    indented code\n\tand tabs", "ünïcödé and 漢字 and emoji 🙂🙂"] * 20


def _fast_tokenizer(pre_tokenizer: str = "byte_level", normalizer=None):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if pre_tokenizer == "byte_level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        alphabet = []
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet,
                                  special_tokens=["<|im_start|>", "[UNK]"])
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_byte_level_bound_is_the_longest_piece_and_holds():
    from pagedllm.tokenizer import max_chars_per_token

    tok = _fast_tokenizer()
    bound = max_chars_per_token(tok)
    assert bound == max(len(p) for p in tok.get_vocab())
    texts = ["hello world " * 50, " " * 3000, "🙂" * 100, "<|im_start|>" * 30,
             "the quick brown fox\n" * 40, "漢字ünï" * 80]
    for text in texts:
        assert len(text) <= len(tok.encode(text)) * bound


def test_tokenizers_that_drop_characters_have_no_bound():
    from tokenizers import normalizers

    from pagedllm.tokenizer import max_chars_per_token

    assert max_chars_per_token(_fast_tokenizer("whitespace")) is None  # spaces vanish
    assert max_chars_per_token(_fast_tokenizer(normalizer=normalizers.Strip())) is None
    assert max_chars_per_token(object()) is None  # not a fast tokenizer
    nfc = _fast_tokenizer(normalizer=normalizers.NFC())
    assert max_chars_per_token(nfc) == 4 * max(len(p) for p in nfc.get_vocab())


def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing():
    from pagedllm.engine.input_processing import InputProcessor, check_prompt_chars
    from pagedllm.tokenizer import max_chars_per_token

    tok = _fast_tokenizer()
    calls = []
    encode = tok.encode
    tok.encode = lambda text, **kw: calls.append(text) or encode(text, **kw)
    proc = InputProcessor(tok, vocab_size=len(tok), max_model_len=16,
                          check_fits=lambda n, k: None)
    bound = max_chars_per_token(tok)
    with pytest.raises(ValueError, match="maximum context length is 16 tokens.*characters"):
        proc.tokenize("a" * (16 * bound + 1))
    assert calls == []
    assert proc.tokenize("hello world")[1] == encode("hello world")
    check_prompt_chars("x" * 10**6, 16, None)  # no bound: nothing refused


# ---- chat templates ---------------------------------------------------------------------------

HOSTILE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


def _render(template: str) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment().from_string(template).render()


def test_render_time_limit_stops_a_runaway_template_and_removes_its_tracer():
    from pagedllm.tokenizer import TemplateTimeoutError, render_time_limit

    before = sys.gettrace()
    t0 = time.monotonic()
    with pytest.raises(TemplateTimeoutError, match="longer than 0.3 s"):
        with render_time_limit(0.3):
            _render(HOSTILE)
    assert time.monotonic() - t0 < 1.5
    assert sys.gettrace() is before
    with render_time_limit(5):
        assert _render("{% for i in range(3) %}{{ i }}{% endfor %}") == "012"


def test_render_time_limit_is_not_swallowed_by_except_exception():
    from pagedllm.tokenizer import TemplateTimeoutError, render_time_limit

    def stubborn() -> None:
        while True:
            try:
                sum(range(10))
            except Exception:  # as jinja's constant folding does
                pass

    with pytest.raises(TemplateTimeoutError):
        with render_time_limit(0.2):
            stubborn()


class _Ctx:
    """ServingContext's render_chat, on a plain jinja sandbox."""

    def render_chat(self, conversation, chat_template, add_generation_prompt,
                    continue_final_message, template_kwargs, tools=None) -> str:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        return ImmutableSandboxedEnvironment().from_string(chat_template).render(
            messages=conversation, **template_kwargs)


class _Request:
    add_generation_prompt = True
    continue_final_message = False

    @staticmethod
    def template_tools():
        return None


def test_request_templates_are_refused_unless_trusted_by_name():
    from pagedllm.entrypoints.openai.chat import RequestTemplates
    from pagedllm.entrypoints.openai.errors import OpenAIError

    untrusted = RequestTemplates()
    assert untrusted.resolve(None, {"enable_thinking": False}) == (None, {"enable_thinking": False})
    with pytest.raises(OpenAIError) as exc:
        untrusted.resolve("{{ x }}", None)
    assert exc.value.status == 400 and exc.value.param == "chat_template"
    assert "--trust-request-chat-template" in exc.value.message
    with pytest.raises(OpenAIError, match="chat_template_kwargs.chat_template"):
        untrusted.resolve(None, {"chat_template": "{{ x }}"})
    trusted = RequestTemplates(trusted=True)
    assert trusted.resolve(None, {"chat_template": "t", "a": 1}) == ("t", {"a": 1})


def test_a_trusted_request_template_is_stopped_past_its_render_timeout():
    from pagedllm.entrypoints.openai.chat import RequestTemplates
    from pagedllm.entrypoints.openai.errors import OpenAIError

    templates = RequestTemplates(trusted=True, render_timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(OpenAIError, match="--chat-template-render-timeout") as exc:
        templates.render(_Ctx(), [], HOSTILE, {}, _Request())
    assert exc.value.status == 400 and time.monotonic() - t0 < 1.5
    ok = templates.render(_Ctx(), [{"content": "hi"}], "{{ messages[0].content }}", {},
                          _Request())
    assert ok == "hi"


# ---- deep JSON schemas ------------------------------------------------------------------------

DEEP = '{"type":"array","items":' * 5000 + '{"type":"string"}' + "}" * 5000


def test_a_deeply_nested_schema_string_is_a_value_error():
    from pagedllm.structured_outputs_params import StructuredOutputsParams

    with pytest.raises(ValueError, match="nested too deeply"):
        StructuredOutputsParams(json=DEEP)


def test_a_deeply_nested_schema_dict_is_a_value_error_in_the_check():
    pytest.importorskip("xgrammar")
    from pagedllm.structured_outputs_params import StructuredOutputsParams
    from pagedllm.structured_output import check_constraint

    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match="nested too deeply"):
        check_constraint(StructuredOutputsParams(json=schema))

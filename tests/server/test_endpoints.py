"""GET /health, /version, /v1/models, /metrics; POST /tokenize, /detokenize; the start-up of
`pagedllm serve` / `python -m pagedllm.entrypoints.openai.api_server` (flags, clear errors)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

import pagedllm
from tests.server.helpers import MAX_MODEL_LEN, MODEL, metric, read_metrics, wait_idle

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier


def test_health_and_version(http, server):
    import httpx

    # /health is open even with --api-key; /version is not.
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert http.get("/version").json() == {"version": pagedllm.__version__}


def test_models_lists_the_default_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0]
    assert card.object == "model" and card.owned_by == "pagedllm"
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert card.model_extra["root"].endswith(".gguf")


def test_tokenize_detokenize_round_trip(http):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world, paged attention!",
                                     "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 3
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert len(body["token_strs"]) == body["count"]
    r = http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "Hello world, paged attention!"}


def test_tokenize_messages_uses_the_chat_template(http, client):
    messages = [{"role": "user", "content": "Name a color."}]
    body = http.post("/tokenize", json={"messages": messages}).json()
    text = http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert "<|im_start|>user\nName a color.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")  # add_generation_prompt defaults to true
    # The chat endpoint renders the same prompt: its usage counts exactly these tokens.
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                          temperature=0)
    assert chat.usage.prompt_tokens == body["count"]


def test_tokenize_errors(http):
    r = http.post("/tokenize", json={})
    assert r.status_code == 400 and "exactly one of" in r.json()["error"]["message"]
    r = http.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"]
    r = http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404


def test_metrics_parse_and_move_after_a_request(http, client):
    before = wait_idle(http)
    out = client.completions.create(model=MODEL, prompt="The capital of France is",
                                    max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 6
    after = wait_idle(http)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:prefix_cache_queries_total") >= out.usage.prompt_tokens
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert delta(f"vllm:{hist}_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 5  # 6 tokens, 5 gaps
    assert delta("vllm:e2e_request_latency_seconds_sum") > 0
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "pagedllm:num_requests_swapped",
                  "vllm:kv_cache_usage_perc", "pagedllm:kv_cache_used_blocks", "vllm:num_preemptions_total"):
        assert (gauge, (("engine", "0"), ("model_name", MODEL))) in after


def test_metrics_show_the_running_request(http, client):
    """While a long request runs, the gauges see it: one running, blocks in use."""
    import threading

    done = threading.Event()

    def run():
        client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=48,
                                  temperature=0, extra_body={"ignore_eos": True})
        done.set()

    t = threading.Thread(target=run)
    t.start()
    seen = False
    while not done.is_set() and not seen:
        m = read_metrics(http)
        seen = (metric(m, "vllm:num_requests_running") == 1
                and metric(m, "pagedllm:kv_cache_used_blocks") >= 1
                and 0 < metric(m, "vllm:kv_cache_usage_perc") < 1)
    t.join()
    assert seen
    assert metric(wait_idle(http), "pagedllm:kv_cache_used_blocks") == 0


# ---- start-up ----------------------------------------------------------------------------


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout)


def test_api_server_module_flags():
    proc = _run(["-m", "pagedllm.entrypoints.openai.api_server", "--help"])
    assert proc.returncode == 0, proc.stderr
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--dtype",
                 "--max-model-len", "--block-size", "--kv-cache-space",
                 "--gpu-memory-utilization", "--swap-space", "--max-num-seqs",
                 "--max-num-batched-tokens", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--tensor-parallel-size", "--quantization",
                 "--enforce-eager", "--seed", "--chat-template", "--uvicorn-log-level"):
        assert flag in proc.stdout, flag


def test_unsupported_flags_are_clear_startup_errors():
    proc = _run(["-m", "pagedllm.entrypoints.openai.api_server",
                 "--tensor-parallel-size", "2"])
    assert proc.returncode == 2
    assert "tensor_parallel_size=2 does not divide the model's 9 attention heads" in proc.stderr
    proc = _run(["-m", "pagedllm.entrypoints.cli", "serve", "--quantization", "bitsandbytes"])
    assert proc.returncode == 2
    assert "quantization='bitsandbytes' is not supported" in proc.stderr
    proc = _run(["-m", "pagedllm.entrypoints.cli", "serve", "--port", "70000"])
    assert proc.returncode == 2 and "port must be in [0, 65535]" in proc.stderr


def test_busy_port_fails_before_the_model_loads():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = _run(["-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port)])
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "Engine ready" not in proc.stderr


def test_chat_template_flag_reaches_the_server(tmp_path):
    """--chat-template FILE is read into the engine config, which the server renders with."""
    import argparse
    from types import SimpleNamespace

    from pagedllm.entrypoints.arg_utils import (
        add_engine_args,
        add_server_args,
        engine_config_from_args,
    )
    from pagedllm.entrypoints.openai.serving import ServingContext

    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[bot]"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    add_engine_args(parser, model_positional=True)
    config = engine_config_from_args(parser.parse_args(["--chat-template", str(path)]))
    assert config.chat_template == template

    class Tok:  # a tokenizer without a template of its own
        chat_template = None

        def apply_chat_template(self, conversation, chat_template, **kw):
            from jinja2 import Template

            return Template(chat_template).render(messages=conversation)

    from pagedllm.engine.engine_info import EngineInfo

    info = EngineInfo(model_name="m", model_root="/x", max_model_len=8, vocab_size=10,
                      num_blocks=4, block_size=16, chat_template=config.chat_template,
                      startup_seconds=0.0, kernel_info={})
    ctx = ServingContext(SimpleNamespace(info=info, tokenizer=Tok()))
    try:
        text = ctx.render_chat([{"role": "user", "content": "hi"}], None, True, False, None)
        assert text == "[user]hi[bot]"
    finally:
        ctx.close()

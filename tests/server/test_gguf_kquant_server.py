"""`pagedllm serve` on a Q4_K_M-style GGUF (K-quant and Q5 matrices read in place by
kernels/gguf_gemm.c, the engine core in its own process): hostile requests get a 400 naming the
field and lose nothing, a plain request still succeeds afterwards, the log carries the weight
memory by form, and /metrics reports the kernel."""

from __future__ import annotations

import openai
import pytest

from pagedllm.quantization.kernels.gguf_kernel import kernel_takes
from tests.server.conftest import serving

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not kernel_takes("Q4_K", 256), reason="gguf_gemm.c cannot be built here")]


def test_kquant_server_refuses_hostile_values_and_then_serves(smollm2_kquant_gguf):
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", smollm2_kquant_gguf, "--kv-cache-space", "0.25",
                  "--max-model-len", "1024", "--quant-compute", "int8"]) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=120.0)
        model = client.models.list().data[0].id
        for bad, field in ((dict(max_tokens=-3), "max_tokens"), (dict(temperature=-1.0), "temperature"),
                           (dict(max_tokens=10**9), "maximum context length"), (dict(logprobs=10**6), "logprobs")):
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model=model, prompt="Hello", **bad)
            assert field in str(err.value), (bad, str(err.value))
        hostile_prompt = "\u0000\uffff" * 300 + "x" * 5000  # over the context: refused, nothing leaks
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt=hostile_prompt, max_tokens=8)
        out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.usage.completion_tokens == 4
        log = srv.log_tail(200_000)
        assert "GGUF blocks in place" in log and "widened" not in log, log[-3000:]

"""The engine over the Triton attention backend (`attention_backend="triton"`) gives the tokens the
torch backend gives: decode, chunked prefill, prefix-cache hits, through the model runner's
varlen metadata. Without a GPU the kernels run in Triton's interpreter on CPU tensors
(`TRITON_INTERPRET=1`, read when a kernel is first jitted), so a tiny model keeps this short;
on a GPU the same kernels are compiled (benchmarks/gpu_check.sh runs the kernel tests there).
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.layers.attention import Attention
from pagedllm.layers.backends import triton_attention_kernels
from tests.integration.test_tiny_models import _save_tiny, _tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not triton_attention_kernels.HAS_TRITON, reason="triton is not installed"),
]

PREFIX = "A shared system prompt that is long enough to fill more than two blocks of eight tokens. "
FIRST = [PREFIX + "First question?", "Short", "1, 2, 3, 4, 5, 6,"]
# Later: a prefix-cache hit on PREFIX, and a prompt longer than the step budget (chunked prefill).
SECOND = [PREFIX + "Second question, a different one?",
          "A long prompt, " * 8 + "that the scheduler must split over several steps of 32 tokens."]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_gguf):
    path = tmp_path_factory.mktemp("tiny-llama-triton")
    _save_tiny("llama", path, _tokenizer(smollm2_gguf))
    return str(path)


def _run(path: str, backend: str) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, device="cpu", attention_backend=backend, kv_cache_space=0.05, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=32, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(FIRST, params, use_tqdm=False)]
    tokens += [o.outputs[0].token_ids for o in llm.generate(SECOND, params, use_tqdm=False)]
    return tokens, llm


def test_triton_backend_matches_torch_backend(tiny_llama, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got, llm = _run(tiny_llama, "triton")
    backends = {m.backend.name for m in llm.llm_engine.model.modules() if isinstance(m, Attention)}
    assert backends == {"triton"}
    stats = llm.kv_cache_stats()
    assert stats.prefix_cache_hits > 0, stats  # the second PREFIX prompt hit the cache
    expected, _ = _run(tiny_llama, "torch")
    assert got == expected

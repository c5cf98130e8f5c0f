"""The engine on a CUDA GPU (marked `gpu`: skipped without one; benchmarks/gpu_check.sh runs them).

A tiny random Llama with a word-level tokenizer (no files from the network, none from SmolLM2's
GGUF, which does not travel to the GPU machine). float32 so that tokens are comparable exactly:
CUDA graphs replay the eager step's kernels (equal tokens), the Triton and torch backends attend
over the same cache values (equal greedy tokens on a peaked tiny model), the pool follows
gpu_memory_utilization, and a too-small one is the error that says what to do.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.integration.model_fixtures import make_hf_model, save_checkpoint, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], list(range(30, 75)), [100], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from benchmarks.gpu_check import save_word_tokenizer

    config = tiny_config("llama", num_key_value_heads=1)  # GQA 4/1
    path = save_checkpoint(make_hf_model(config, seed=5), tmp_path_factory.mktemp("gpu-llama"))
    save_word_tokenizer(config.vocab_size, path)
    return str(path)


def _tokens(llm: LLM, max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _utilization(kv_gib: float) -> float:
    """A utilization that leaves about `kv_gib` GiB for the cache on this GPU (a tiny model's
    blocks are 4 KiB: a large fraction of an H200 would be millions of them, slow to set up)."""
    import torch

    total = torch.cuda.mem_get_info()[1]
    return min(0.9, (kv_gib + 1.0) * (1 << 30) / total)


def _llm(path: str, **kw) -> LLM:
    base = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256,
                gpu_memory_utilization=_utilization(1.0))
    base.update(kw)
    return LLM(path, **base)


def test_cuda_graphs_give_the_eager_tokens(tiny_path):
    graphed = _llm(tiny_path)
    runner = graphed.llm_engine.model_runner
    assert runner.cuda_graphs is not None and runner.cuda_graphs.batch_sizes == [1, 2, 4, 8]
    got = _tokens(graphed)
    assert runner.cuda_graphs.steps_run > 10
    eager = _llm(tiny_path, enforce_eager=True)
    assert eager.llm_engine.model_runner.cuda_graphs is None
    assert got == _tokens(eager)


def test_triton_and_torch_backends_agree(tiny_path):
    triton = _tokens(_llm(tiny_path, attention_backend="triton", enforce_eager=True, max_num_batched_tokens=16))
    torch_ = _tokens(_llm(tiny_path, attention_backend="torch", max_num_batched_tokens=16))
    assert triton == torch_


def test_fp8_cache_on_the_triton_backend(tiny_path):
    import torch

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 caches need compute capability 8.9+")
    got = _tokens(_llm(tiny_path, kv_cache_dtype="fp8", attention_backend="triton"), max_tokens=8)
    ref = _tokens(_llm(tiny_path, kv_cache_dtype="fp8", attention_backend="torch"), max_tokens=8)
    assert sum(a == b for a, b in zip(got, ref)) >= len(PROMPTS) - 1  # one near-tie may flip


def test_pool_follows_gpu_memory_utilization(tiny_path):
    small = _llm(tiny_path, gpu_memory_utilization=_utilization(1.0)).llm_engine.core
    large = _llm(tiny_path, gpu_memory_utilization=_utilization(3.0)).llm_engine.core
    assert small.memory_profile is not None and small.memory_profile.weights > 0
    assert large.num_blocks > 2 * small.num_blocks


def test_too_little_memory_says_what_to_do(tiny_path):
    with pytest.raises(ValueError, match="largest max_model_len that fits|No memory is left|weights take"):
        _llm(tiny_path, gpu_memory_utilization=0.0001)

"""The engine's default kernel choice (layers/kernel_choice.py, `PAGEDLLM_KERNEL_CHOICE=measure`)
on the default model: its quantized layers keep the packed kernels with no float32 copy and
nothing measured, and greedy output equals transformers' whichever path each batch bucket takes
(the exact kernel and torch's op on the dequantized weights are both exact).

transformers' greedy output is stored (tests/references.py); the Llama family's live check is
test_engine_parity.py::test_chat_api_matches_transformers."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.layers import kernel_choice
from tests.integration.test_engine_parity import hf_greedy
from tests.references import reference

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "List three colours:"]


@pytest.fixture
def measuring(monkeypatch, tmp_path, smollm2_gguf):
    import shutil

    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(smollm2_gguf, cache)  # the kernel cache folder is the model cache folder
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(cache))
    monkeypatch.setenv(kernel_choice.MODE_ENV, "measure")
    monkeypatch.setattr(kernel_choice, "_table", None)
    monkeypatch.setattr(kernel_choice, "_spent_s", 0.0)
    monkeypatch.setattr(kernel_choice, "_used", {})
    monkeypatch.setattr(kernel_choice, "_choices", {})
    monkeypatch.setattr(kernel_choice, "_noisy", False)
    from pagedllm.quantization.kernels import int_kernel

    monkeypatch.setattr(int_kernel, "_float_copy_bytes", 0)  # the process-wide copy budget, afresh
    return cache


def _greedy_equals_hf(llm, request, smollm2_gguf) -> None:
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0.0, max_tokens=24),
                        use_tqdm=False)
    refs = reference("kernel_choice_engine.greedy",
                     lambda: [hf_greedy(request.getfixturevalue("hf_smollm2"), p, 24) for p in ids],
                     sources=[smollm2_gguf], inputs={"prompts": ids, "max_new": 24}, libs=("transformers", "gguf"))
    for out, ref in zip(outs, refs, strict=True):
        assert out.outputs[0].token_ids == ref


def test_the_default_keeps_packed_kernels_without_float_copies(measuring, smollm2_gguf, request):
    from pagedllm.quantization.kernels import int_kernel

    llm = LLM(smollm2_gguf, kv_cache_space=0.25, max_model_len=512)
    used = kernel_choice.used()
    # qkv, o, gate_up, down and the tied LM head: each keeps the exact kernel in every bucket
    assert len(used) == 5 and all(v == ("exact",) * len(kernel_choice.BUCKETS) for v in used.values()), used
    assert kernel_choice.spent_seconds() == 0.0 and int_kernel._float_copy_bytes == 0
    assert not list((measuring / "kernels").glob("choices-*.json"))
    _greedy_equals_hf(llm, request, smollm2_gguf)


def test_greedy_parity_when_torch_takes_some_buckets(measuring, monkeypatch, smollm2_gguf, request):
    """Torch's op at 2-64 rows, the exact kernel elsewhere: prefill and decode both cross paths
    (float copies of quantized weights are made only in the A/B mode `torch`)."""
    monkeypatch.setenv(kernel_choice.MODE_ENV, "torch")
    monkeypatch.setattr(kernel_choice, "_choose",
                        lambda key, cands, *a, **k: tuple(("torch" if b in (1, 2) else next(iter(cands)))
                                                          for b in range(len(kernel_choice.BUCKETS))))
    llm = LLM(smollm2_gguf, kv_cache_space=0.25, max_model_len=512)
    assert all(v[1] == "torch" and v[0] == "exact" for v in kernel_choice.used().values())
    _greedy_equals_hf(llm, request, smollm2_gguf)

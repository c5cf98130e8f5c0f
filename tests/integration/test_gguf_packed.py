"""The default model's GGUF Q4_1 / Q8_0 matrices kept packed (quantization/gguf.py).

- no float32 copy stays: the projections and the (tied) embedding hold only int_gemm.c's form;
- the exact path's greedy output equals the previous path's (weights dequantized to float32 at
  load, PAGEDLLM_GGUF_BLOCKS=0), token for token;
- the int8 path (`quant_compute="int8"`) generates the same text for most of its length: its
  first divergence from exact is recorded, not hidden.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.quantization.kernels.int_kernel import int_gemm_isa
from tests.integration.prompts import PROMPTS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(int_gemm_isa() is None, reason="the int_gemm C kernel cannot be built here"),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def _outputs(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_packed_gguf_keeps_no_float_copy_and_equals_the_float_path(monkeypatch, smollm2_llm):
    packed = smollm2_llm  # the default settings keep the GGUF packed
    model = packed.llm_engine.model
    for layer in model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert lin.int_weight is not None and getattr(lin, "weight", None) is None
    assert model.model.embed_tokens.int_weight is not None and model.model.embed_tokens.weight is None
    float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert float_bytes < 1_000_000  # norms only: every matrix is packed
    packed_ids = _outputs(packed)

    monkeypatch.setenv("PAGEDLLM_GGUF_BLOCKS", "0")
    dense = LLM(kv_cache_space=0.25)
    assert dense.llm_engine.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert _outputs(dense) == packed_ids


def test_int8_path_runs_and_stays_close(smollm2_llm):
    exact = _outputs(smollm2_llm)  # quant_compute's default on this model is the exact path
    int8 = _outputs(LLM(kv_cache_space=0.25, quant_compute="int8"))
    first_diff = []
    for a, b in zip(exact, int8):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first_diff.append(n)
    print("int8 vs exact, first differing token per prompt:", first_diff)
    assert all(len(b) > 0 for b in int8)
    assert sum(first_diff) / len(first_diff) >= 4  # not garbage from the first tokens on

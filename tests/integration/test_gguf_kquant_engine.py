"""A Q4_K_M-style file of the default model (Q5_0 / Q5_1 / Q8_0 and Q4_K / Q6_K matrices, kept in
the file's blocks: kernels/gguf_gemm.c) through the engine in its modes, against transformers
loading the same file: greedy output equal token for token with chunked prefill at a small
budget, a prefix-cache hit and preemption by recompute; nothing widened to float32. (The int8
path is checked against the exact one per kernel in tests/unit/test_gguf_kernel.py: this file's
random ffn_down blocks make a model too erratic to compare whole generations.)

transformers' output on the file is stored (tests/references.py): its load alone takes tens of
seconds. The live check of GGUF K-quant dequantization is
test_gguf_loader.py::test_every_gguf_type_kept_in_its_blocks_matches_transformers (gguf-py's
`dequantize`, which transformers' GGUF loader calls, on tiny files of every type); transformers'
GGUF loader itself is checked live on the default model by
test_engine_parity.py::test_chat_api_matches_transformers."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.quantization.kernels.gguf_kernel import kernel_takes
from pagedllm.model.loader import weight_memory
from tests.integration.prompts import PROMPTS
from tests.integration.test_engine_parity import hf_greedy
from tests.references import reference as stored_reference

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not kernel_takes("Q4_K", 256), reason="gguf_gemm.c cannot be built here")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _hf_greedy_on(gguf_path: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gguf_path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return [hf_greedy(hf, p, max_new) for p in prompts]


@pytest.fixture(scope="module")
def reference(smollm2_kquant_gguf):
    llm = LLM(smollm2_kquant_gguf, kv_cache_space=0.25)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS[:6]]
    expected = stored_reference("gguf_kquant_engine.greedy",
                                lambda: _hf_greedy_on(smollm2_kquant_gguf, ids, GREEDY.max_tokens),
                                sources=[smollm2_kquant_gguf], inputs={"prompts": ids, "max_new": GREEDY.max_tokens},
                                libs=("transformers", "gguf"))
    return llm, [{"prompt_token_ids": p} for p in ids], expected


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_every_matrix_stays_in_its_blocks_and_greedy_equals_transformers(reference):
    llm, prompts, expected = reference
    model = llm.llm_engine.model
    layer = model.model.layers[0]
    types = {p.type_name for lin in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj) for p in lin.gguf_weights}
    assert types == {"Q5_0", "Q8_0", "Q5_1"}
    assert {model.model.layers[i].mlp.down_proj.gguf_weights[0].type_name for i in (0, 1)} == {"Q4_K", "Q6_K"}
    assert weight_memory(model)["float"] < 1_000_000  # norms only
    assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    before = llm.kv_cache_stats().prefix_cache_hits
    assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected  # a prefix-cache hit
    assert llm.kv_cache_stats().prefix_cache_hits > before


def test_chunked_prefill_and_preemption_keep_the_output(smollm2_kquant_gguf, reference):
    _, prompts, expected = reference
    chunked = LLM(smollm2_kquant_gguf, max_num_batched_tokens=24, max_num_seqs=8, kv_cache_space=0.25,
                  enable_prefix_caching=False)
    assert _ids(chunked.generate(prompts, GREEDY, use_tqdm=False)) == expected
    small = LLM(smollm2_kquant_gguf, num_kv_blocks=10, enable_prefix_caching=False)
    assert _ids(small.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = small.kv_cache_stats()
    assert stats.num_preemptions > 0 and stats.used_blocks == 0

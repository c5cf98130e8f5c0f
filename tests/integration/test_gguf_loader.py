"""GGUF loading: the default SmolLM2 Q4_1 file against transformers' own GGUF loader, tiny GGUF
files written here (mixed quantization types, llama.cpp's Q/K permutation), and the errors.

transformers' side on SmolLM2 is stored (tests/references.py; the Llama family's live check is
test_engine_parity.py::test_chat_api_matches_transformers). The tiny GGUF tests compute theirs
every run (a forward of a 2-layer model whose weights the test needs anyway to write the file):
`test_every_gguf_type_kept_in_its_blocks_matches_transformers` is the live check of GGUF
K-quant dequantization (gguf-py's `dequantize`, the call transformers' GGUF loader makes for
every tensor, and transformers' Llama reverse permute), whose stored counterpart is
test_gguf_kquant_engine.py's reference (transformers loading a K-quant SmolLM2 file)."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch
from transformers import AutoConfig, GenerationConfig, GPT2Config

from pagedllm.model import get_model_class, load_model
from pagedllm.model.gguf_loader import gguf_to_hf_name
from pagedllm.quantization.formats.gguf_block_decoding import dequantize_tensor
from pagedllm.worker import ModelRunner
from tests.integration.model_fixtures import (
    hf_logits,
    make_hf_model,
    step_plan,
    table_step,
    tiny_config,
)
from tests.references import reference

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

# SmolLM2's chat template around "Explain in two sentences why the sky is blue during the day and
# red at sunset." with the default system prompt, tokenized by the GGUF's own tokenizer.
PROMPT_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 30, 2, 198, 1, 4093,
    198, 36971, 281, 827, 8545, 1701, 260, 6376, 314, 4461, 981, 260, 1194, 284, 2382, 418, 21822,
    30, 2, 198, 1, 520, 9531, 198,
]  # fmt: skip
SMOLLM2_ATOL = 2e-3  # 30 layers of float32 with differently fused matrix products


@pytest.fixture(scope="module")
def smollm2_config(smollm2_gguf):
    folder, name = os.path.split(smollm2_gguf)
    return AutoConfig.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def smollm2_ours(smollm2_gguf, smollm2_config):
    folder, name = os.path.split(smollm2_gguf)
    return load_model(folder, name, smollm2_config, torch.float32, torch.device("cpu"))


def _hf_final_hidden(hf_model, token_ids: list[int]) -> list[list[float]]:
    """transformers' final hidden states (after the last norm: what its LM head multiplies),
    each float32 written in its shortest decimal form (it reads back to the same float32)."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([token_ids])).last_hidden_state[0].float()
    return [[float(str(v)) for v in row] for row in hidden.numpy()]


@functools.cache
def _token_embd(gguf_path: str) -> torch.Tensor:
    """The GGUF's token table as transformers' GGUF loader reads it: its blocks dequantized by
    gguf-py's `dequantize` (SmolLM2's LM head is tied to it). The blocks are found with the
    engine's own index (gguf.GGUFReader spends 3 s on the vocabulary's metadata): were it wrong,
    the engine's embeddings would be too, and its logits would leave transformers' anyway."""
    from gguf.quants import dequantize

    from pagedllm.model.gguf_index import read_gguf_index

    tensor = next(t for t in read_gguf_index(gguf_path).tensors if t.name == "token_embd.weight")
    return torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())


def smollm2_reference_logits(request, smollm2_gguf: str, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits `[len, vocab]` on SmolLM2 (what `hf_logits` gives): its final
    hidden states are stored (24k floats; the logits are 2M), its tied LM head is applied
    here with the same matrix product (`F.linear`) on the same dequantized token table."""
    hidden = reference("gguf_loader.smollm2_final_hidden",
                       lambda: _hf_final_hidden(request.getfixturevalue("hf_smollm2"), token_ids),
                       sources=[smollm2_gguf], inputs={"prompt": token_ids}, libs=("transformers", "gguf"))
    return torch.nn.functional.linear(torch.tensor([hidden], dtype=torch.float32), _token_embd(smollm2_gguf))[0]


def test_smollm2_gguf_logits_match_transformers(smollm2_ours, smollm2_config, smollm2_gguf, request) -> None:
    runner = ModelRunner(smollm2_ours, smollm2_config, 16, 16, torch.float32, "cpu")
    seq = table_step(0, PROMPT_IDS, 0, [7, 2, 11], sample=True, all_logits=True)
    out = runner.execute_model(step_plan([seq]))
    ref = smollm2_reference_logits(request, smollm2_gguf, PROMPT_IDS)
    ours = out.all_logits[0]
    diff = (ours - ref).abs().max().item()
    print(f"SmolLM2 GGUF prefill: max |logits diff| = {diff:.3g} over {ref.shape}")
    assert diff < SMOLLM2_ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm2_gguf_greedy_decode_matches_transformers(smollm2_ours, smollm2_config, smollm2_gguf, request) -> None:
    """Chunked prefill (16-token chunks) then greedy decode, against transformers' generate."""
    block_size, new_tokens = 8, 12
    runner = ModelRunner(smollm2_ours, smollm2_config, 32, block_size, torch.float32, "cpu")
    table = [19, 4, 27, 0, 13, 8, 30, 22, 5]
    tokens = list(PROMPT_IDS)
    pos = 0
    while len(tokens) < len(PROMPT_IDS) + new_tokens:
        n = min(16, len(tokens) - pos)
        seq = table_step(0, tokens[pos : pos + n], pos, table, sample=pos + n == len(tokens))
        out = runner.execute_model(step_plan([seq]))
        pos += n
        if seq.sample:
            tokens.append(int(out.sample_logits[0].argmax()))

    def hf_generate():
        gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        return request.getfixturevalue("hf_smollm2").generate(
            torch.tensor([PROMPT_IDS]), attention_mask=torch.ones(1, len(PROMPT_IDS), dtype=torch.long),
            generation_config=gen
        )[0].tolist()

    ref = reference("gguf_loader.smollm2_greedy", hf_generate, sources=[smollm2_gguf],
                    inputs={"prompt": PROMPT_IDS, "max_new": new_tokens}, libs=("transformers", "gguf"))
    assert ref == tokens


def test_unsupported_architecture_raises() -> None:
    with pytest.raises(ValueError, match=r"Model architecture\(s\) \['GPT2LMHeadModel'\] are not supported"):
        get_model_class(GPT2Config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match=r"\['gpt2'\] are not supported by pagedllm. Supported architectures: generate: \['LlamaForCausalLM'"):
        get_model_class(GPT2Config())  # GGUF configs have no `architectures`: model_type decides
    assert get_model_class(tiny_config("qwen2", architectures=None)).__name__ == "LlamaForCausalLM"


# ---- tiny GGUF files written here ------------------------------------------------------------

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_TYPES = {
    "attn_q": "Q8_0",
    "attn_k": "Q4_1",
    "attn_v": "F16",
    "attn_output": "Q4_0",
    "ffn_gate": "Q5_0",
    "ffn_up": "BF16",
    "ffn_down": "Q8_0",
    "token_embd": "Q8_0",
    "output": "F16",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(hf_model, config, gguf_arch: str, path, types: dict[str, str] | None = None) -> None:
    """Write `hf_model` as llama.cpp would (permuted Q/K for `llama`), in mixed quantization
    types (`types`: per llama.cpp tensor kind, default `_TYPES`), and round `hf_model`'s weights
    to what the file holds, so both sides see the same. Types gguf-py cannot quantize (the
    K-quants, IQ4) get random valid blocks of about the weights' size (tests/gguf_random.py)."""
    import gguf
    from gguf.quants import dequantize, quantize

    from tests.gguf_random import F16_FIELDS, random_tensor

    types = _TYPES if types is None else types
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    unpermute = LlamaTensorProcessor(
        {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
    )
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    with torch.no_grad():
        for hf_name, param in hf_model.state_dict().items():
            if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # llama.cpp writes no output.weight for a tied head
            name = _gguf_name(hf_name)
            kind = name.split(".")[-2]
            w = param.numpy().astype(np.float32)
            if gguf_arch == "llama" and kind == "attn_q":
                w = _llama_cpp_permute(w, config.num_attention_heads)
            elif gguf_arch == "llama" and kind == "attn_k":
                w = _llama_cpp_permute(w, config.num_key_value_heads)
            qtype = gguf.GGMLQuantizationType[types.get(kind, "F32") if w.ndim == 2 else "F32"]
            if qtype == gguf.GGMLQuantizationType.F32:
                data = w
            elif qtype == gguf.GGMLQuantizationType.F16:
                data = w.astype(np.float16)
            elif qtype.name in F16_FIELDS and qtype.name not in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
                data = random_tensor(qtype.name, *w.shape, seed=len(name), typical=float(np.abs(w).mean()))
            else:
                data = quantize(w, qtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
            stored = dequantize(data, qtype).reshape(w.shape)
            if gguf_arch == "llama" and kind in ("attn_q", "attn_k"):
                stored = unpermute.process(stored, name).weights  # transformers' own reverse permute
            param.copy_(torch.from_numpy(np.ascontiguousarray(stored)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    "arch,gguf_arch,overrides",
    [
        ("llama", "llama", dict(attention_bias=True)),  # permuted Q/K weights and biases, GQA
        ("mistral", "llama", dict(sliding_window=None, tie_word_embeddings=True)),  # llama.cpp stores Mistral as llama
        ("qwen2", "qwen2", dict()),  # not permuted by llama.cpp; q/k/v biases
        ("qwen3", "qwen3", dict(head_dim=32)),  # per-head q/k norms, head_dim != hidden / heads
    ],
)
def test_tiny_gguf_with_mixed_quant_types_matches_transformers(tmp_path, arch, gguf_arch, overrides) -> None:
    config = tiny_config(arch, **overrides)
    hf_model = make_hf_model(config, seed=11)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(hf_model, config, gguf_arch, path)
    model = load_model(str(tmp_path), "tiny.gguf", config, torch.float32, "cpu")
    runner = ModelRunner(model, config, 8, 16, torch.float32, "cpu")
    prompt = [(7 * i + 3) % config.vocab_size for i in range(37)]
    out = runner.execute_model(
        step_plan([table_step(0, prompt, 0, [5, 1, 6], all_logits=True)])
    )
    torch.testing.assert_close(out.all_logits[0], hf_logits(hf_model, prompt), atol=1e-4, rtol=0)
    # The .gguf path alone also works.
    assert load_model(str(path), None, config, torch.float32, "cpu") is not None


_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd", "output")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                                   "Q6_K", "IQ4_NL", "IQ4_XS", "F16", "BF16"])
def test_every_gguf_type_kept_in_its_blocks_matches_transformers(tmp_path, qtype) -> None:
    """Every matrix of the file in `qtype` (embedding and untied head too): each stays in the
    file's blocks (no float weight anywhere), and the logits of a 37-token prefill (the panel
    path) and of single-token decodes equal transformers' on the same values."""
    from pagedllm.quantization.kernels.gguf_kernel import kernel_takes

    if not kernel_takes(qtype, 256):
        pytest.skip("gguf_gemm.c cannot be built here")
    config = tiny_config("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2)
    hf_model = make_hf_model(config, seed=5)
    _write_tiny_gguf(hf_model, config, "llama", tmp_path / "t.gguf", types={k: qtype for k in _KINDS})
    model = load_model(str(tmp_path / "t.gguf"), None, config, torch.float32, "cpu")
    layer = model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.mlp.down_proj, model.lm_head):
        assert getattr(lin, "weight", None) is None and (lin.gguf_weights or lin.int_weight is not None)
    assert model.model.embed_tokens.weight is None
    from pagedllm.model.loader import weight_memory

    memory = weight_memory(model)
    assert memory["float"] < 8 * 1024, memory  # norms only: every matrix stays packed
    runner = ModelRunner(model, config, 8, 16, torch.float32, "cpu")
    prompt = [(7 * i + 3) % config.vocab_size for i in range(37)]
    out = runner.execute_model(
        step_plan([table_step(0, prompt, 0, [5, 1, 6], all_logits=True)])
    )
    ref = hf_logits(hf_model, prompt)
    torch.testing.assert_close(out.all_logits[0], ref, atol=1e-4 * max(1.0, float(ref.abs().max())), rtol=0)


def test_unsupported_gguf_tensor_type_raises(tmp_path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    writer.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    # One IQ2_XXS block row: 256 weights in 66 bytes; the content is irrelevant.
    writer.add_tensor(
        "token_embd.weight", np.zeros((4, 66), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = tiny_config("llama", hidden_size=256, vocab_size=4, num_hidden_layers=0)
    with pytest.raises(ValueError, match="Unsupported GGUF tensor type IQ2_XXS for tensor 'token_embd.weight'"):
        load_model(str(tmp_path / "iq.gguf"), None, config, torch.float32, "cpu")


def test_gguf_tensor_names() -> None:
    assert gguf_to_hf_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="Unsupported tensor 'blk.0.ffn_gate_exps.weight'"):
        gguf_to_hf_name("blk.0.ffn_gate_exps.weight")


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_dequantize_is_bit_identical_to_gguf(type_name) -> None:
    import gguf
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[type_name]
    w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32) * 3
    data = w if qtype == gguf.GGMLQuantizationType.F32 else (
        w.astype(np.float16) if qtype == gguf.GGMLQuantizationType.F16 else quantize(w, qtype)
    )
    ours = dequantize_tensor(data, qtype).reshape(6, 96).float()
    assert torch.equal(ours, torch.from_numpy(dequantize(data, qtype).reshape(6, 96)))

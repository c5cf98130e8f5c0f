"""Mixture-of-experts architectures (Mixtral, Qwen2-MoE, Qwen3-MoE) on tiny random checkpoints
made by transformers' own classes: greedy output of the whole engine equal to transformers'
`generate` in every engine mode and with tensor parallelism over 2 ranks; prefill logits; the
prompts route to every expert of every sparse layer, as transformers' routers choose; the fused
checkpoint form (`save_pretrained(save_original_format=False)`) loads to the same model; GPTQ
experts; bad checkpoints are errors that name the tensor as the checkpoint spells it.

transformers' outputs (tokens, logits, routers' choices) are stored references
(tests/references.py, arch_parity): Qwen2-MoE's one-shot prefill mode computes its greedy
reference live every run, the mixture-of-experts family's check that the store has not drifted
from transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from pagedllm.layers.moe import ExpertMLP, SparseMoeBlock, TopKRouter
from pagedllm.model import get_model_class, load_model
from pagedllm.model.llama import LlamaMLP
from tests.integration.arch_parity import (
    MODES,
    LazyModel,
    build_tiny,
    check_engine_greedy,
    our_prefill_logits,
    prefill_logits_max_abs,
    record,
    reference_prefix,
    save_tokenizer,
    tiny_prompts,
)
from tests.integration.model_fixtures import checkpoint_sources
from tests.references import reference

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

VOCAB = 1000
_BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, tie_word_embeddings=False)
CONFIGS = {
    # 8 experts, top 2, GQA 4/2, a sliding window shorter than most prompts.
    "mixtral": lambda: tf.MixtralConfig(**_BASE, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                                        sliding_window=16),
    # 8 experts, top 4, not renormalised; the shared expert with its sigmoid gate; layer 1 dense.
    # Expert sizes split into whole GPTQ groups of 32 over 2 ranks (the GPTQ test).
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(**_BASE, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
                                           num_experts_per_tok=4, shared_expert_intermediate_size=128,
                                           norm_topk_prob=False, mlp_only_layers=[1]),
    # Qwen3 attention (head_dim 32 != 64 / 4), 8 experts, top 2 renormalised; layer 2 dense.
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**_BASE, head_dim=32, intermediate_size=128, moe_intermediate_size=64,
                                           num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                           mlp_only_layers=[2]),
}
SPARSE_LAYERS = {"mixtral": [0, 1, 2], "qwen2_moe": [0, 2], "qwen3_moe": [0, 1]}


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = build_tiny(CONFIGS[request.param](), path, seed=len(request.param))
    no_eos(hf)
    return request.param, path, hf, reference_prefix(request, request.param)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(tiny, mode):
    name, path, hf, refs = tiny
    check_engine_greedy(name, path, hf, mode, refs, live=name == "qwen2_moe" and mode == "whole-prefill")


def test_greedy_matches_transformers_tensor_parallel(tiny):
    """2 ranks: each expert's intermediate size split, one all-reduce per block."""
    name, path, hf, refs = tiny
    check_engine_greedy(f"{name}-tp2", path, hf, "whole-prefill", refs, tensor_parallel_size=2)


def test_model_structure_and_logits(tiny):
    name, path, hf, refs = tiny
    prefill_logits_max_abs(name, path, hf, tiny_prompts(VOCAB), refs)
    model = load_model(str(path), None, hf.config, torch.float32, "cpu")
    assert type(model) is get_model_class(hf.config)
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if i in SPARSE_LAYERS[name]:
            assert isinstance(mlp, SparseMoeBlock) and len(mlp.experts) == 8
            assert (mlp.shared_expert is not None) == (name == "qwen2_moe")
            for expert in mlp.experts:  # the C kernels' form, made once after loading
                assert expert.gate_up_proj.prepared is not None and expert.down_proj.prepared is not None
        else:
            assert type(mlp) is LlamaMLP
    assert (model.model.layers[0].self_attn.qkv_proj.bias is not None) == (name == "qwen2_moe")
    if name == "qwen3_moe":
        assert model.head_dim == 32 and hasattr(model.model.layers[0].self_attn, "q_norm")


class RouterLog:
    """Every router's chosen expert ids, by layer, while installed (a global forward hook)."""

    def __init__(self, router_cls, ids_of):
        self.router_cls, self.ids_of = router_cls, ids_of
        self.ids: list[torch.Tensor] = []

    def __enter__(self):
        def hook(module, args, output):
            if isinstance(module, self.router_cls):
                self.ids.append(self.ids_of(output).detach().clone())
        self.handle = torch.nn.modules.module.register_module_forward_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _hf_routing(hf, name: str, sequences: list[list[int]]) -> list[list[list[list[int]]]]:
    """transformers' routers' chosen expert ids: per sequence, per sparse layer, [len, top-k]."""
    hf_router = type(hf.model.layers[SPARSE_LAYERS[name][0]].mlp.gate)
    theirs = []
    for s in sequences:  # one sequence at a time: transformers' routers see [len, hidden]
        with RouterLog(hf_router, lambda out: out[2]) as log, torch.no_grad():
            hf(torch.tensor([s]))
        theirs.append([ids.tolist() for ids in log.ids])
    return theirs


def test_prompts_route_to_every_expert_as_transformers_routes(tiny):
    name, path, hf, refs = tiny
    sequences = tiny_prompts(VOCAB)
    with RouterLog(TopKRouter, lambda out: out[1]) as ours:
        our_prefill_logits(path, hf.config, sequences)
    theirs = [[torch.tensor(ids) for ids in per_layer] for per_layer in reference(
        f"{refs}.routing", lambda: _hf_routing(hf, name, sequences), sources=[path], inputs={"sequences": sequences})]
    sparse = SPARSE_LAYERS[name]
    assert len(ours.ids) == len(sparse)  # one batched prefill: each sparse layer's router once
    tokens = sum(len(s) for s in sequences)
    for j, layer in enumerate(sparse):
        ids = ours.ids[j]
        assert ids.shape[0] == tokens
        hit = torch.bincount(ids.reshape(-1), minlength=8)
        assert bool((hit > 0).all()), f"{name} layer {layer}: experts without tokens: {hit.tolist()}"
        ref = torch.cat([t[j] for t in theirs])
        assert torch.equal(ids.sort(-1).values, ref.sort(-1).values), f"{name} layer {layer}: routing differs"
        record(name, f"routing-layer{layer}", True, tokens_per_expert=hit.tolist())


def no_eos(hf) -> None:
    """Our engine runs with ignore_eos; transformers' greedy reference (`hf_greedy`'s
    min_new_tokens) would instead mask the EOS id whenever the model's generation config names
    one, so the two would part wherever EOS is the greedy choice (it is, once, for qwen2_moe)."""
    hf.generation_config.eos_token_id = None


# ---- checkpoint forms and errors ----------------------------------------------------------
def _copy_folder(src: Path, dst: Path, edit=None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        sd = load_file(str(dst / "model.safetensors"))
        edit(sd)
        save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _expert_name(name: str, layer: int, expert: int, which: str) -> str:
    """The Hub's name of one expert tensor (`which`: gate, up, down)."""
    if name == "mixtral":
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{dict(gate='w1', up='w3', down='w2')[which]}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{which}_proj.weight"


def test_fused_checkpoint_form_loads_the_same_model(tiny, tmp_path):
    name, path, hf, refs = tiny
    fused = tmp_path / "fused"
    hf.save_pretrained(fused, save_original_format=False)
    save_tokenizer(fused, VOCAB)
    keys = set(load_file(str(fused / "model.safetensors")))
    layer = SPARSE_LAYERS[name][0]
    assert f"model.layers.{layer}.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys)
    sequences = tiny_prompts(VOCAB)[:2]
    per_expert = our_prefill_logits(path, hf.config, sequences)
    from_fused = our_prefill_logits(fused, hf.config, sequences)
    for a, b in zip(per_expert, from_fused):
        assert torch.equal(a, b)
    # transformers' model is the per-expert checkpoint's: its stored greedy reference
    check_engine_greedy(f"{name}-fused", fused, hf, "whole-prefill", refs, source=path, tensor_parallel_size=2)


def _bad(name: str, path: Path, tmp: Path, edit) -> str:
    folder = _copy_folder(path, tmp, edit)
    config = tf.AutoConfig.from_pretrained(folder)
    with pytest.raises(ValueError) as info:
        load_model(str(folder), None, config, torch.float32, "cpu")
    return str(info.value)


def test_bad_checkpoints_name_the_tensor(tiny, tmp_path):
    name, path, hf, _ = tiny
    layer = SPARSE_LAYERS[name][0]
    gate3 = _expert_name(name, layer, 3, "gate")
    msg = _bad(name, path, tmp_path / "missing", lambda sd: sd.pop(gate3))
    assert "missing 1 weight" in msg and gate3 in msg, msg
    down5 = _expert_name(name, layer, 5, "down")
    msg = _bad(name, path, tmp_path / "missing-down", lambda sd: sd.pop(down5))
    assert down5 in msg, msg
    extra = _expert_name(name, layer, 8, "up")
    msg = _bad(name, path, tmp_path / "extra", lambda sd: sd.update({extra: sd[_expert_name(name, layer, 0, "up")].clone()}))
    assert "Unexpected weight" in msg and extra in msg, msg
    down0 = _expert_name(name, layer, 0, "down")
    msg = _bad(name, path, tmp_path / "shape", lambda sd: sd.update({down0: sd[down0][:, :-1].contiguous()}))
    assert "Shape mismatch" in msg and down0 in msg and "checkpoint has (64, " in msg, msg

    fused = tmp_path / "fused"
    hf.save_pretrained(fused, save_original_format=False)
    save_tokenizer(fused, VOCAB)
    gate_up = f"model.layers.{layer}.mlp.experts.gate_up_proj"
    msg = _bad(name, fused, tmp_path / "fused-shape", lambda sd: sd.update({gate_up: sd[gate_up][:, :-2].contiguous()}))
    inter = hf.config.intermediate_size if name == "mixtral" else hf.config.moe_intermediate_size
    assert f"Shape mismatch loading {gate_up}: checkpoint has (8, {2 * inter - 2}, 64)" in msg, msg
    msg = _bad(name, fused, tmp_path / "fused-experts", lambda sd: sd.update({gate_up: sd[gate_up][:7]}))
    assert "checkpoint has (7, " in msg, msg
    both = load_file(str(path / "model.safetensors"))
    msg = _bad(name, fused, tmp_path / "both", lambda sd: sd.update({gate3: both[gate3]}))
    assert "both per-expert and fused expert tensors" in msg and f"model.layers.{layer}.mlp" in msg, msg


# ---- quantized experts --------------------------------------------------------------------
def _gptq_folder(name: str, path: Path, out: Path) -> Path:
    """A GPTQ int4 (groups of 32) folder of the tiny checkpoint: `pagedllm quantize` for the
    Qwen names; Mixtral's `w1 / w3 / w2` experts are not among its projections, so its
    checkpoint is packed here with the quantizer's own functions, under the Hub's names."""
    from pagedllm.quantization.algorithms.checkpoint_writer import quantization_config, quantize_model, quantize_tensors

    if name != "mixtral":
        return quantize_model(str(path), str(out), fmt="gptq", bits=4, group_size=32)
    sd = load_file(str(path / "model.safetensors"))
    projections = {n[: -len(".weight")]: sd.pop(n) for n in list(sd)
                   if n.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))}
    sd.update(quantize_tensors(projections, "gptq", 4, 32, True))
    shutil.copytree(path, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config("gptq", 4, 32, True, False, "gptq")
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_gptq_experts_equal_transformers_on_the_dequantized_weights(tiny, tmp_path):
    from tests.integration.test_quantized_checkpoints import dequantized_state_dict

    name, path, hf, _ = tiny
    folder = _gptq_folder(name, path, tmp_path / "gptq")
    ref_folder = tmp_path / "dequantized"
    shutil.copytree(folder, ref_folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((ref_folder / "config.json").read_text())
    config.pop("quantization_config")
    (ref_folder / "config.json").write_text(json.dumps(config))
    dequantized = dequantized_state_dict(folder)
    save_file(dequantized, str(ref_folder / "model.safetensors"), metadata={"format": "pt"})
    gate0 = _expert_name(name, SPARSE_LAYERS[name][0], 0, "gate")
    original = load_file(str(path / "model.safetensors"))[gate0]
    assert not torch.equal(dequantized[gate0], original)  # int4: the experts' weights did change
    torch.testing.assert_close(dequantized[gate0], original, rtol=0, atol=0.2)

    def load_reference():  # only to compute transformers' side: a stored run never loads it
        ref = tf.AutoModelForCausalLM.from_pretrained(ref_folder, dtype=torch.float32,
                                                      attn_implementation="eager").eval()
        no_eos(ref)
        return ref

    ref = LazyModel(tf.AutoConfig.from_pretrained(ref_folder), load_reference)
    model = load_model(str(folder), None, tf.AutoConfig.from_pretrained(folder), torch.float32, "cpu",
                       quant_compute="exact")
    expert = model.model.layers[SPARSE_LAYERS[name][0]].mlp.experts[0]
    assert isinstance(expert, ExpertMLP)
    for proj in (expert.gate_up_proj, expert.down_proj):  # packed for the int kernel, no float copy
        assert proj.quant_method is not None and proj.int_weight is not None and not hasattr(proj, "weight")
    del model
    # transformers on the dequantized folder (less the path `pagedllm quantize` records), shared with tp=2
    refs, source = f"arch_moe.{name}-gptq", checkpoint_sources(ref_folder)
    check_engine_greedy(f"{name}-gptq", folder, ref, "whole-prefill", refs, source=source, quant_compute="exact")
    if name == "mixtral":  # 96 / 2 = 48 rows per rank: not whole groups of 32
        from pagedllm import LLM

        with pytest.raises(ValueError, match=r"experts\.0\.down_proj: tensor parallelism would split a quantization "
                                             r"group: the 96 input rows split into shards of 48"):
            LLM(str(folder), tensor_parallel_size=2, quant_compute="exact")
        return
    check_engine_greedy(f"{name}-gptq-tp2", folder, ref, "whole-prefill", refs, source=source,
                        quant_compute="exact", tensor_parallel_size=2)


def test_compiled_decode_graphs_equal_eager(tiny, monkeypatch):
    """CPU compiled decode graphs (torch.compile of the decode step): the experts stay eager
    inside the compiled step; greedy output equal to the eager engine's. Inductor's GEMM
    autotuning is left out here (it was two thirds of this test's minute on 2 cores): what it
    picks is checked by tests/integration/test_compiled_decode.py, and the experts run outside
    the graph either way."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.worker import decode_graphs

    name, path, hf, _ = tiny
    if name != "qwen2_moe":
        pytest.skip("one architecture (router, shared expert, dense layer) is enough: compiling takes ~25 s")
    monkeypatch.setattr(decode_graphs, "INDUCTOR_OPTIONS", {
        k: v for k, v in decode_graphs.INDUCTOR_OPTIONS.items() if not k.startswith("max_autotune")})
    prompts = [{"prompt_token_ids": p} for p in tiny_prompts(VOCAB)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 14, 20, 8)]
    llm = LLM(str(path), block_size=8, max_num_seqs=4, enforce_eager=False, compile_batch_sizes=[4])
    try:
        runner = llm.llm_engine.model_runner
        assert runner.wait_for_compilation(timeout=600), runner.decode_graphs._failed
        before = runner.decode_graphs.steps_run
        compiled = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert runner.decode_graphs.steps_run - before > 10
    finally:
        llm.shutdown()
    eager = LLM(str(path), block_size=8, max_num_seqs=4, enforce_eager=True)
    try:
        assert compiled == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    finally:
        eager.shutdown()

"""Multi-LoRA through the offline engine on a tiny Llama with adapters made by peft: greedy
output equals peft's PeftModel token for token (each adapter alone, and mixed with the base
in one batch), prompt logprobs agree with peft's, a request never runs with another adapter's
weights (more adapters than slots, preemption shuffling rows), prefix caching keyed by the
adapter, n > 1, beams, swap, structured outputs, and bad adapters refused by name with the
engine still serving.

peft's outputs are stored references (tests/references.py, lora_fixtures.lora_reference); the
`all7` adapter's are computed live every run, peft's check that the store has not drifted."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.integration.lora_fixtures import (ADAPTERS, adapter_sources, greedy, lora_reference, make_tiny_lora,
                                             tokenizer)
from tests.integration.model_fixtures import checkpoint_sources
from tests.references import reference as stored_reference

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

PROMPTS = ["The quick brown fox jumps over", "Once upon a time, in a land far away,",
           "1, 2, 3, 4, 5, 6,", "Paged attention keeps the KV cache in blocks so that"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_gguf):
    return make_tiny_lora(tmp_path_factory.mktemp("lora"), smollm2_gguf)


@pytest.fixture(scope="module")
def loras(tiny):
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(tiny.adapters.items())}


def _ids(smollm2_gguf) -> list[list[int]]:
    tok = tokenizer(smollm2_gguf)
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(tiny, smollm2_gguf):
    """name (None: base) -> per prompt: (prompt ids, peft's greedy tokens, peft's prompt logprobs)."""
    ids = _ids(smollm2_gguf)
    out = {}
    for name in [None, *ADAPTERS]:
        ref = lora_reference(f"lora.{name or 'base'}", tiny, name, ids, MAX_TOKENS, logprobs=True,
                             live=name == "all7")
        out[name] = [(p, g, torch.tensor(lp, dtype=torch.float32))
                     for p, g, lp in zip(ids, ref["greedy"], ref["prompt_logprobs"])]
    return out


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny.base), enable_lora=True, max_loras=3, max_lora_rank=16, kv_cache_space=0.05, block_size=8)


def _params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def _run(llm, reference, loras, names, **kw):
    prompts = [{"prompt_token_ids": reference[n][i % len(PROMPTS)][0]} for i, n in enumerate(names)]
    return llm.generate(prompts, _params(**kw), use_tqdm=False,
                        lora_request=[None if n is None else loras[n] for n in names])


def test_each_adapter_alone_equals_peft(llm, reference, loras):
    for name in [None, *ADAPTERS]:
        outs = _run(llm, reference, loras, [name] * len(PROMPTS))
        for i, out in enumerate(outs):
            assert list(out.outputs[0].token_ids) == reference[name][i][1], (name, i)
            assert out.lora_request == (None if name is None else loras[name])  # vLLM's field
    # the adapters matter: their outputs differ from the base model's
    for name in ADAPTERS:
        assert [r[1] for r in reference[name]] != [r[1] for r in reference[None]], name


def test_a_batch_mixing_three_adapters_and_the_base_equals_peft_and_logprobs_agree(llm, reference, loras):
    names = [None, "all7", "qv_rs", "mlp16"] * 2
    prompts = [{"prompt_token_ids": reference[n][i % len(PROMPTS)][0]} for i, n in enumerate(names)]
    outs = llm.generate(prompts, _params(prompt_logprobs=0), use_tqdm=False,
                        lora_request=[None if n is None else loras[n] for n in names])
    worst = 0.0
    for i, (name, out) in enumerate(zip(names, outs)):
        ids, want, want_lp = reference[name][i % len(PROMPTS)]
        assert list(out.outputs[0].token_ids) == want, (name, i)
        got_lp = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])])
        worst = max(worst, float((got_lp - want_lp).abs().max()))
    print(f"LoRA parity: prompt logprobs max |engine - peft| = {worst:.2e}")
    assert worst < 1e-3


def test_more_adapters_than_slots_with_preemption_never_mixes_weights(tiny, reference, loras):
    """max_loras=2 slots for 3 adapters + base, a pool so small that requests are preempted
    (rows reshuffled, slots reassigned): each request's output is its own adapter's."""
    small = LLM(str(tiny.base), enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=12, block_size=8,
                max_num_seqs=6)
    names = [None, "all7", "qv_rs", "mlp16", "all7", "mlp16", "qv_rs", None, "qv_rs", "all7"]
    prompts = [{"prompt_token_ids": reference[n][i % len(PROMPTS)][0]} for i, n in enumerate(names)]
    outs = small.generate(prompts, _params(), use_tqdm=False,
                          lora_request=[None if n is None else loras[n] for n in names])
    for i, (name, out) in enumerate(zip(names, outs)):
        assert list(out.outputs[0].token_ids) == reference[name][i % len(PROMPTS)][1], (name, i)
    stats = small.kv_cache_stats()
    assert stats.num_preemptions > 0
    assert small.llm_engine.kv_cache_manager.num_free_blocks == small.llm_engine.kv_cache_manager.num_usable_blocks


def test_prefix_cache_is_keyed_by_the_adapter(llm, reference, loras):
    ids = reference[None][3][0] * 3  # several full blocks
    p = [{"prompt_token_ids": ids}]
    llm.reset_prefix_cache()
    first = llm.generate(p, _params(), use_tqdm=False, lora_request=loras["all7"])[0]
    again = llm.generate(p, _params(), use_tqdm=False, lora_request=loras["all7"])[0]
    other = llm.generate(p, _params(), use_tqdm=False, lora_request=loras["qv_rs"])[0]
    base = llm.generate(p, _params(), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0


def test_n_samples_beams_swap_and_structured_outputs_with_adapters(tiny, reference, loras):
    eng = LLM(str(tiny.base), enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=14, block_size=8,
              preemption_mode="swap", swap_space=0.01)
    ids = reference["all7"][0][0]
    outs = eng.generate([{"prompt_token_ids": ids}] * 3, _params(n=2), use_tqdm=False,
                        lora_request=[loras["all7"], loras["mlp16"], None])
    for out, name in zip(outs, ["all7", "mlp16", None]):
        assert [list(c.token_ids) for c in out.outputs] == [reference[name][0][1]] * 2, name
    from pagedllm import BeamSearchParams

    beams = eng.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=2, max_tokens=6),
                            lora_request=loras["qv_rs"])
    assert len(beams[0].outputs) == 2
    constrained = eng.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs={"regex": "[0-9]{3}"}), use_tqdm=False,
        lora_request=loras["all7"])[0]
    text = constrained.outputs[0].text
    assert len(text) == 3 and text.isdigit(), text


def test_bad_adapters_are_refused_by_name_and_the_engine_goes_on(llm, tiny, reference, tmp_path):
    ids = reference[None][0][0]
    p = [{"prompt_token_ids": ids}]
    cases = []
    cases.append((LoRARequest("missing", 50, str(tmp_path / "nope")), "nope"))
    big = tmp_path / "big"
    _copy_with_config(tiny.adapters["all7"], big, r=32)
    cases.append((LoRARequest("big", 51, str(big)), "32"))
    head = tmp_path / "head"
    _copy_with_config(tiny.adapters["all7"], head, target_modules=["q_proj", "lm_head"])
    cases.append((LoRARequest("head", 52, str(head)), "lm_head"))
    cases.append((LoRARequest("clash", 1, str(tiny.adapters["mlp16"])), "lora_int_id 1"))
    for lora, words in cases:
        with pytest.raises(ValueError, match=words):
            llm.generate(p, _params(), use_tqdm=False, lora_request=lora)
    out = llm.generate(p, _params(), use_tqdm=False)[0]  # the engine still serves
    assert list(out.outputs[0].token_ids) == reference[None][0][1]
    plain = LLM(str(tiny.base), kv_cache_space=0.05)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate(p, _params(), use_tqdm=False, lora_request=LoRARequest("x", 1, str(tiny.adapters["all7"])))


def _copy_with_config(src, dst, **changes) -> None:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))


def test_tensor_parallel_adapters_equal_one_rank(tiny, reference, loras):
    tp = LLM(str(tiny.base), enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_space=0.05, block_size=8,
             tensor_parallel_size=2)
    try:
        names = ["all7", "qv_rs", None, "mlp16"]
        prompts = [{"prompt_token_ids": reference[n][i][0]} for i, n in enumerate(names)]
        outs = tp.generate(prompts, _params(), use_tqdm=False,
                           lora_request=[None if n is None else loras[n] for n in names])
        for i, (name, out) in enumerate(zip(names, outs)):
            assert list(out.outputs[0].token_ids) == reference[name][i][1], (name, i)
    finally:
        tp.shutdown()


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_adapters_over_a_quantized_base_equal_peft_over_its_dequantized_weights(fmt, tiny, loras, reference,
                                                                               tmp_path):
    """A GPTQ / AWQ base (4-bit, groups of 32: the integer kernels' packed form) with float LoRA
    deltas on top: greedy output equals peft over transformers' model of the weights the
    checkpoint dequantizes to, each adapter and the base mixed in one batch."""
    from peft import PeftModel

    from pagedllm.quantization.algorithms.checkpoint_writer import quantize_model
    from tests.integration.test_quantized_checkpoints import reference_model

    out = quantize_model(str(tiny.base), str(tmp_path / fmt), fmt=fmt, bits=4, group_size=32)
    llm = LLM(str(out), enable_lora=True, max_loras=3, max_lora_rank=16, kv_cache_space=0.05, block_size=8,
              quant_compute="exact")
    layer = llm.llm_engine.model.model.layers[0].self_attn.qkv_proj
    assert layer.quant_method is not None and layer.int_weight is not None and layer.lora is not None
    names = [None, *ADAPTERS, "all7"]
    outs = _run(llm, reference, loras, names)
    items = [(name, reference[name][i % len(PROMPTS)][0]) for i, name in enumerate(names)]

    def compute():
        tokens = []
        for name, prompt in items:
            ref = reference_model(out)
            if name is not None:
                ref = PeftModel.from_pretrained(ref, tiny.adapters[name]).eval()
            tokens.append(greedy(ref, prompt, MAX_TOKENS))
        return tokens

    sources = checkpoint_sources(out) + [s for name in ADAPTERS for s in adapter_sources(tiny.adapters[name])]
    theirs = stored_reference(f"lora.{fmt}-base", compute, sources=sources, libs=("transformers", "peft"),
                              inputs={"items": items, "max_tokens": MAX_TOKENS, "base": "reference_model"},
                              machine_made=True)  # a quantizer's output: see quantized_checkpoints
    for (name, _), o, want in zip(items, outs, theirs):
        assert list(o.outputs[0].token_ids) == want, (fmt, name)
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:4]}) == 4  # the adapters matter here too

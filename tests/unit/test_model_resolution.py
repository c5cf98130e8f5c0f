"""model/resolution.py decides, once, what a model is and how it runs. Folders saved by
transformers' own classes: GPT-2 (no runner runs it) was told it "cannot run as a pooling model"
when asked to generate; LLaVA (before it ran, issue 45) crashed in `EngineCore.__init__` on `hf_config.vocab_size`."""

from __future__ import annotations

import pytest

from pagedllm.config import EngineConfig

SUPPORTED_LISTS = r"Supported architectures: generate: \[.*LlamaForCausalLM.*\]; pooling: \[.*BertModel.*\]"


def _tiny_gpt2(folder, headless: bool) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    (GPT2Model if headless else GPT2LMHeadModel)(cfg).save_pretrained(folder)
    return str(folder)


def _tiny_paligemma(folder) -> str:
    """A multimodal architecture pagedllm does not run (LLaVA, which this test used, now runs)."""
    from transformers import GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration, SiglipVisionConfig

    text = GemmaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    PaliGemmaForConditionalGeneration(PaliGemmaConfig(text_config=text.to_dict(), vision_config=vision.to_dict())
                                      ).save_pretrained(folder)
    return str(folder)


def _tiny_bert(folder) -> str:
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=32)).save_pretrained(folder)
    return str(folder)


# ---- the defects, through the public entry points -----------------------------------------

@pytest.mark.parametrize("headless,arch", [(False, "GPT2LMHeadModel"), (True, "GPT2Model")])
@pytest.mark.parametrize("runner", ["auto", "generate"])
def test_gpt2_asked_to_generate_is_told_it_is_unsupported_with_each_runners_list(tmp_path, headless, arch, runner):
    from pagedllm import LLM

    folder = _tiny_gpt2(tmp_path / "gpt2", headless)
    with pytest.raises(ValueError, match=rf"\['{arch}'\] are not supported by pagedllm. {SUPPORTED_LISTS}") as err:
        LLM(folder, runner=runner)
    assert "pooling model" not in str(err.value)


def test_an_unsupported_multimodal_model_is_refused_by_name_through_llm_and_a_direct_engine_core(tmp_path):
    from pagedllm import LLM
    from pagedllm.engine.core import EngineCore

    folder = _tiny_paligemma(tmp_path / "paligemma")
    expected = rf"\['PaliGemmaForConditionalGeneration'\] are not supported by pagedllm. {SUPPORTED_LISTS}"
    with pytest.raises(ValueError, match=expected):
        LLM(folder)
    with pytest.raises(ValueError, match=expected):
        EngineCore(EngineConfig(model=folder))


def test_a_direct_engine_core_of_a_pooling_model_is_a_pooling_core(tmp_path):
    """Pooling is a task of the one core (engine/core_pooling.py): an encoder's resolution makes
    the core a pooling core, which refuses generation requests by name."""
    from pagedllm.engine.core import EngineCore
    from pagedllm.engine.core_messages import EngineCoreRequest
    from pagedllm.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(model=_tiny_bert(tmp_path / "bert")))
    assert core.pooling is not None and core.pooling.is_encoder and core.resolution.architecture == "BertModel"
    with pytest.raises(ValueError, match="is a pooling model: it does not serve generation requests"):
        core.add_request(EngineCoreRequest("g", [1, 2], SamplingParams(), 0.0))


# ---- the decision ----------------------------------------------------------------------------

@pytest.mark.parametrize("archs,requested,expected", [
    (["LlamaForCausalLM"], "auto", ("LlamaForCausalLM", "generate", False)),
    (["LlamaForCausalLM"], "generate", ("LlamaForCausalLM", "generate", False)),
    (["Qwen3ForCausalLM"], "pooling", ("Qwen3Model", "pooling", False)),  # its headless form
    (["Qwen3Model"], "auto", ("Qwen3Model", "pooling", False)),
    (["BertModel"], "auto", ("BertModel", "pooling", True)),
    (["XLMRobertaForSequenceClassification"], "pooling", ("XLMRobertaForSequenceClassification", "pooling", True)),
    (["GPT2LMHeadModel", "MistralForCausalLM"], "auto", ("MistralForCausalLM", "generate", False)),
])
def test_choose_architecture(archs, requested, expected):
    from pagedllm.model.resolution import choose_architecture

    choice = choose_architecture(archs, requested, is_gguf=False)
    assert (choice.architecture, choice.runner, choice.is_encoder) == expected


@pytest.mark.parametrize("archs,requested,is_gguf,message", [
    (["BertModel"], "generate", False, r"BertModel is an encoder: it runs only as a pooling model.*generate runner "
                                       r"supports \['LlamaForCausalLM'"),
    (["LlamaModel"], "generate", False, r"LlamaModel has no LM head: it runs only as a pooling model.*cannot generate"),
    (["Phi3ForCausalLM"], "pooling", False, r"Phi3ForCausalLM runs only as a generation model.*pooling runner "
                                            r"supports \['BertModel'"),
    (["LlamaForCausalLM"], "pooling", True, r"GGUF embedding models are not supported"),
    (["ModernBertModel"], "auto", False, r"ModernBertModel: ModernBERT is not supported yet"),
    (["GPT2LMHeadModel"], "pooling", False, rf"\['GPT2LMHeadModel'\] are not supported by pagedllm. {SUPPORTED_LISTS}"),
    (["LlamaForCausalLM"], "embed", False, r"runner must be 'auto', 'generate' or 'pooling', got 'embed'"),
])
def test_choose_architecture_refuses_with_a_precise_error(archs, requested, is_gguf, message):
    from pagedllm.model.resolution import choose_architecture

    with pytest.raises(ValueError, match=message):
        choose_architecture(archs, requested, is_gguf)


# ---- the resolution of real files ------------------------------------------------------------

def test_a_folder_resolves_for_each_runner_with_its_class(tiny_llama_folder):
    from pagedllm.model.decoder_embedders import LlamaModel
    from pagedllm.model.llama import LlamaForCausalLM
    from pagedllm.model.resolution import model_resolution, serving_runner

    gen = model_resolution(EngineConfig(model=tiny_llama_folder))
    assert (gen.architecture, gen.runner, gen.is_encoder, gen.is_gguf) == ("LlamaForCausalLM", "generate", False, False)
    assert gen.model_class() is LlamaForCausalLM and gen.hf_config.architectures == ["LlamaForCausalLM"]
    pooled = model_resolution(EngineConfig(model=tiny_llama_folder, runner="pooling"))
    assert (pooled.architecture, pooled.runner, pooled.model_class()) == ("LlamaModel", "pooling", LlamaModel)
    assert serving_runner(EngineConfig(model=tiny_llama_folder)) == "generate"
    assert serving_runner(EngineConfig(model=tiny_llama_folder, task="embed")) == "pooling"


def test_a_gguf_file_resolves_by_its_model_type(smollm2_gguf):
    from pagedllm.model.resolution import model_resolution, serving_runner

    res = model_resolution(EngineConfig(model=smollm2_gguf))
    assert (res.architecture, res.runner, res.is_gguf) == ("LlamaForCausalLM", "generate", True)
    assert serving_runner(EngineConfig(model=smollm2_gguf)) == "generate"
    with pytest.raises(ValueError, match="GGUF embedding models are not supported"):
        serving_runner(EngineConfig(model=smollm2_gguf, runner="pooling"))


def test_an_encoder_has_no_pagedllm_class(tmp_path):
    from pagedllm.model.resolution import model_resolution, serving_runner

    config = EngineConfig(model=_tiny_bert(tmp_path / "bert"))
    res = model_resolution(config)
    assert (res.architecture, res.runner, res.is_encoder, res.is_classifier) == ("BertModel", "pooling", True, False)
    assert serving_runner(config) == "pooling"
    with pytest.raises(ValueError, match="BertModel is an encoder: transformers loads it"):
        res.model_class()


def test_serving_runner_refuses_what_model_resolution_refuses(tmp_path):
    from pagedllm.model.resolution import serving_runner

    with pytest.raises(ValueError, match=rf"\['GPT2LMHeadModel'\] are not supported by pagedllm. {SUPPORTED_LISTS}"):
        serving_runner(EngineConfig(model=_tiny_gpt2(tmp_path / "gpt2", headless=False)))


def test_llm_resolves_the_model_once(tiny_llama_folder, monkeypatch):
    import pagedllm.engine.core as core
    import pagedllm.model.resolution as resolution
    from pagedllm import LLM

    calls = []
    real = resolution.model_resolution

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(resolution, "model_resolution", counted)
    monkeypatch.setattr(core, "model_resolution", counted)
    llm = LLM(tiny_llama_folder, kv_cache_space=0.01, max_model_len=64)
    assert len(calls) == 1 and llm.llm_engine.core.resolution.architecture == "LlamaForCausalLM"

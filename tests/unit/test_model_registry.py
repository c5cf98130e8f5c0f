"""The architecture registry: every registered name resolves to an importable model class (the
table names modules lazily, so a typo would otherwise surface only when that model is served);
unknown architectures are a clear error listing what each runner supports; GGUF configs (no
`architectures`) resolve by `model_type`."""

from types import SimpleNamespace

import pytest
from torch import nn

from pagedllm.model import registry
from pagedllm.model.registry import architecture_of, get_model_class, supported_architectures


@pytest.mark.parametrize("arch", [*registry.GENERATE_ARCHS, *registry.HEADLESS_ARCHS])
def test_every_registered_decoder_imports(arch):
    cls = get_model_class(SimpleNamespace(architectures=[arch]))
    assert cls is registry.model_class(arch)
    assert isinstance(cls, type) and issubclass(cls, nn.Module)
    assert hasattr(cls, "load_weights") and hasattr(cls, "compute_logits")


def test_every_headless_form_is_registered_and_every_pooling_name_listed():
    assert set(registry.HEADLESS_OF) <= set(registry.GENERATE_ARCHS)
    assert set(registry.HEADLESS_OF.values()) <= set(registry.HEADLESS_ARCHS)
    pooling = supported_architectures()["pooling"]
    assert {*registry.ENCODER_EMBED_ARCHS, *registry.ENCODER_CLASSIFY_ARCHS, *registry.HEADLESS_ARCHS} <= set(pooling)


def test_unknown_architecture_lists_what_each_runner_supports():
    with pytest.raises(ValueError, match=r"\['GPTNeoXForCausalLM'\] are not supported by pagedllm. Supported "
                                         r"architectures: generate: \[.*Qwen3ForCausalLM.*\]; pooling: \[.*BertModel"):
        get_model_class(SimpleNamespace(architectures=["GPTNeoXForCausalLM"]))


def test_encoders_have_no_pagedllm_class():
    with pytest.raises(ValueError, match=r"\['BertModel'\] are not supported"):
        get_model_class(SimpleNamespace(architectures=["BertModel"]))  # transformers loads it


@pytest.mark.parametrize("model_type,arch", [("qwen3", "Qwen3ForCausalLM"), ("phi3", "Phi3ForCausalLM"),
                                             ("gemma3_text", "Gemma3ForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")])
def test_gguf_configs_resolve_by_model_type(model_type, arch):
    assert architecture_of(SimpleNamespace(architectures=None, model_type=model_type)) == arch

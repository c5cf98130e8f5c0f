"""The architecture registry: every registered name resolves to an importable model class (the
table names modules lazily, so a typo would otherwise surface only when that model is served);
unknown architectures are a clear error listing the supported ones; GGUF configs (no
`architectures`) resolve by `model_type`."""

from types import SimpleNamespace

import pytest
from torch import nn

from pagedllm.model.registry import POOLING_ONLY, architecture_of, get_model_class, supported_architectures


@pytest.mark.parametrize("arch", supported_architectures())
def test_every_registered_architecture_imports(arch):
    pooling = arch in POOLING_ONLY  # headless decoders load only for pooling (pagedllm/pooling/)
    cls = get_model_class(SimpleNamespace(architectures=[arch], pagedllm_pooling=pooling))
    assert isinstance(cls, type) and issubclass(cls, nn.Module)
    assert hasattr(cls, "load_weights") and hasattr(cls, "compute_logits")


@pytest.mark.parametrize("arch", POOLING_ONLY)
def test_headless_decoders_refuse_generation(arch):
    with pytest.raises(ValueError, match="no LM head"):
        get_model_class(SimpleNamespace(architectures=[arch]))


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"\['GPTNeoXForCausalLM'\] are not supported.*Qwen3ForCausalLM"):
        get_model_class(SimpleNamespace(architectures=["GPTNeoXForCausalLM"]))


@pytest.mark.parametrize("model_type,arch", [("qwen3", "Qwen3ForCausalLM"), ("phi3", "Phi3ForCausalLM"),
                                             ("gemma3_text", "Gemma3ForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")])
def test_gguf_configs_resolve_by_model_type(model_type, arch):
    assert architecture_of(SimpleNamespace(architectures=None, model_type=model_type)) == arch

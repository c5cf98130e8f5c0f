"""Hugging Face architecture name -> pagedllm model class.

The table names each class by module and attribute and imports it only when a config asks for
it (as vLLM's registry does): one architecture's module (and what it imports) costs nothing to
a process that serves another.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# HF `architectures` entry -> (module under pagedllm.model, class name)
_MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    # headless decoders for pooling (embedding) models: pagedllm/pooling/
    "LlamaModel": ("decoder_embedders", "LlamaModel"),
    "MistralModel": ("decoder_embedders", "LlamaModel"),
    "Qwen2Model": ("decoder_embedders", "LlamaModel"),
    "Qwen3Model": ("decoder_embedders", "Qwen3Model"),
}

# Configs read from a GGUF file carry no `architectures`; fall back on `model_type`.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def supported_architectures() -> list[str]:
    return list(_MODEL_REGISTRY)


def architecture_of(hf_config: Any) -> str:
    """The registered architecture name a config asks for; ValueError naming what is supported."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        model_type = getattr(hf_config, "model_type", None)
        archs = [_MODEL_TYPE_TO_ARCH.get(model_type, str(model_type))]
    for arch in archs:
        if arch in _MODEL_REGISTRY:
            return arch
    raise ValueError(
        f"Model architecture(s) {archs} are not supported. Supported architectures: {supported_architectures()}"
    )


# Headless decoders have no LM head: they run only under the pooling runner, which marks the
# config it loads them with (`pagedllm_pooling`); generation would read the embedding as a head.
POOLING_ONLY = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The model class for a transformers config; ValueError for an unsupported architecture."""
    arch = architecture_of(hf_config)
    if arch in POOLING_ONLY and not getattr(hf_config, "pagedllm_pooling", False):
        raise ValueError(f"{arch} has no LM head: it runs as a pooling (embedding) model only "
                         "(runner='pooling', the default for it); it cannot generate.")
    module_name, class_name = _MODEL_REGISTRY[arch]
    module = importlib.import_module(f"pagedllm.model.{module_name}")
    return getattr(module, class_name)

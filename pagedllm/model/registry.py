"""Hugging Face architecture name -> pagedllm model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.model.llama import LlamaForCausalLM

_MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}

# Configs read from a GGUF file carry no `architectures`; fall back on `model_type`.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def supported_architectures() -> list[str]:
    return list(_MODEL_REGISTRY)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The model class for a transformers config; ValueError for an unsupported architecture."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        model_type = getattr(hf_config, "model_type", None)
        archs = [_MODEL_TYPE_TO_ARCH.get(model_type, str(model_type))]
    for arch in archs:
        if arch in _MODEL_REGISTRY:
            return _MODEL_REGISTRY[arch]
    raise ValueError(
        f"Model architecture(s) {archs} are not supported. Supported architectures: {supported_architectures()}"
    )

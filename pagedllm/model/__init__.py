"""Model definitions, the architecture registry, model resolution and weight loading.

Names are imported lazily: `model.resolution` and `model.registry` are asked by `pagedllm serve`
before its engine cores start, and must not import torch on the way (engine/core_start.py)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "LlamaForCausalLM": "pagedllm.model.llama",
    "load_model": "pagedllm.model.loader",
    "get_model_class": "pagedllm.model.registry",
    "supported_architectures": "pagedllm.model.registry",
}
__all__ = ["LlamaForCausalLM", "get_model_class", "load_model", "supported_architectures"]

if TYPE_CHECKING:
    from pagedllm.model.llama import LlamaForCausalLM
    from pagedllm.model.loader import load_model
    from pagedllm.model.registry import get_model_class, supported_architectures


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm.model' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

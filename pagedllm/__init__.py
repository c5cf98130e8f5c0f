"""pagedllm: an LLM inference and serving engine built on PagedAttention.

Public names are imported lazily so that `pagedllm.core` (no torch) loads in milliseconds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
_LAZY = {
    "LLM": "pagedllm.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "BeamSearchParams": "pagedllm.beam_search_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "LLMEngine": "pagedllm.engine.engine",
    "EngineConfig": "pagedllm.config",
    "LoRARequest": "pagedllm.lora.request",
    "PoolingParams": "pagedllm.pooling.params",
    "PoolingRequestOutput": "pagedllm.pooling.outputs",
    "EmbeddingRequestOutput": "pagedllm.pooling.outputs",
    "ClassificationRequestOutput": "pagedllm.pooling.outputs",
    "ScoringRequestOutput": "pagedllm.pooling.outputs",
}
__all__ = [*_LAZY, "__version__"]

if TYPE_CHECKING:
    from pagedllm.beam_search_params import BeamSearchParams
    from pagedllm.config import EngineConfig
    from pagedllm.engine.engine import LLMEngine
    from pagedllm.llm import LLM
    from pagedllm.lora.request import LoRARequest
    from pagedllm.outputs import CompletionOutput, RequestOutput
    from pagedllm.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

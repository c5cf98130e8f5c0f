"""The pooling side of the engine: embeddings, classification, scores (docs/pooling.md).

Names are imported lazily: a process that imports one pooling module (the server's front end)
pays for no other."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    **dict.fromkeys(("ClassificationOutput", "ClassificationRequestOutput", "EmbeddingOutput",
                     "EmbeddingRequestOutput", "PoolingOutput", "PoolingRequestOutput",
                     "ScoringOutput", "ScoringRequestOutput"), "pagedllm.pooling.outputs"),
    "PoolingParams": "pagedllm.pooling.params",
}
__all__ = [
    "ClassificationOutput", "ClassificationRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
    "PoolingOutput", "PoolingParams", "PoolingRequestOutput", "ScoringOutput", "ScoringRequestOutput",
]

if TYPE_CHECKING:
    from pagedllm.pooling.outputs import (ClassificationOutput, ClassificationRequestOutput,
                                          EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput,
                                          PoolingRequestOutput, ScoringOutput, ScoringRequestOutput)
    from pagedllm.pooling.params import PoolingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm.pooling' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

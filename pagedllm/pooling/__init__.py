"""The pooling side of the engine: embeddings, classification, scores (docs/pooling.md)."""

from pagedllm.pooling.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling.params import PoolingParams

__all__ = [
    "ClassificationOutput", "ClassificationRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
    "PoolingOutput", "PoolingParams", "PoolingRequestOutput", "ScoringOutput", "ScoringRequestOutput",
]

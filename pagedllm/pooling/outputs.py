"""Pooling outputs in vLLM's classes: `PoolingRequestOutput` (raw `.outputs.data`) and its typed
views `EmbeddingRequestOutput` (`.outputs.embedding`), `ClassificationRequestOutput`
(`.outputs.probs`) and `ScoringRequestOutput` (`.outputs.score`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch


@dataclass
class PoolingOutput:
    data: torch.Tensor  # float32, 1-D


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @classmethod
    def from_base(cls, out: PoolingOutput) -> "EmbeddingOutput":
        if out.data.ndim != 1:
            raise ValueError("an embedding is one vector")
        return cls(out.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @classmethod
    def from_base(cls, out: PoolingOutput) -> "ClassificationOutput":
        return cls(out.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float

    @classmethod
    def from_base(cls, out: PoolingOutput) -> "ScoringOutput":
        return cls(float(out.data.reshape(-1)[0]))


T = TypeVar("T")


@dataclass
class PoolingRequestOutput(Generic[T]):
    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def pooling_output(request_id: str, pooled: bytes | None, prompt_token_ids: list[int]) -> PoolingRequestOutput:
    """The front end's output of a request the core finished with its vector (float32 bytes)."""
    if pooled is None:
        raise ValueError(f"request {request_id} finished without its pooled vector")
    data = torch.from_numpy(np.frombuffer(pooled, dtype=np.float32).copy())
    return PoolingRequestOutput(request_id, PoolingOutput(data), prompt_token_ids)


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(out.request_id, EmbeddingOutput.from_base(out.outputs), out.prompt_token_ids, out.finished)


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(out.request_id, ClassificationOutput.from_base(out.outputs), out.prompt_token_ids,
                   out.finished)


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ScoringRequestOutput":
        return cls(out.request_id, ScoringOutput.from_base(out.outputs), out.prompt_token_ids, out.finished)

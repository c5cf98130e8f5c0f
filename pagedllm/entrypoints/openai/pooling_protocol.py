"""Request and response bodies of the pooling endpoints: OpenAI's /v1/embeddings, vLLM's
/pooling, /classify, /score, and the Jina / Cohere rerank shape. Unlike the generation
bodies these forbid unknown fields: a field pagedllm does not implement is a 400 naming it
(the validation error's `param`), never ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from pagedllm.entrypoints.openai.protocol_base import now_seconds, random_uuid

# OpenAI's limit on the inputs of one embeddings request
MAX_INPUTS = 2048


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, for the client's bookkeeping
    truncate_prompt_tokens: StrictInt | None = None


# a string, strings, token ids, or lists of token ids (OpenAI's `input`)
EmbeddingInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class EmbeddingRequest(_Request):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    normalize: bool | None = None  # vLLM's extra


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the pooled vectors as they are (`data`)."""


class ClassificationRequest(_Request):
    input: StrictStr | list[StrictStr]


class ScoreRequest(_Request):
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: StrictStr


class RerankRequest(_Request):
    """Jina's and Cohere's shape (vLLM's /rerank, /v1/rerank, /v2/rerank)."""

    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: StrictInt | None = None
    return_documents: bool = True


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"embd-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_seconds)
    model: str
    data: list[EmbeddingData]
    usage: Usage


class PoolingData(BaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: list[float] | str


class PoolingResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"pool-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_seconds)
    model: str
    data: list[PoolingData]
    usage: Usage


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"classify-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_seconds)
    model: str
    data: list[ClassificationData]
    usage: Usage


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"score-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_seconds)
    model: str
    data: list[ScoreData]
    usage: Usage


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: dict[str, Any] | None = None


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{random_uuid()}")
    model: str
    usage: dict[str, int]
    results: list[RerankResult]

"""Hidden states -> the request's vector: pool (last token / mean / [CLS]), the
sentence-transformers Dense layers, Matryoshka truncation, L2 normalisation; classifier
logits -> probabilities. Each in float32, in the order sentence-transformers applies them."""

from __future__ import annotations

import torch

from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.pooler_config import PoolerConfig


def pool(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """One vector from a sequence's final hidden states `[n, H]` (no padding)."""
    if pooling_type == "LAST":
        return hidden[-1]
    if pooling_type == "CLS":
        return hidden[0]
    if pooling_type == "MEAN":
        return hidden.float().mean(dim=0)
    raise ValueError(f"unknown pooling type {pooling_type!r}")


def embedding_dimensions(config: PoolerConfig, hidden_size: int) -> int:
    """The size of the model's embeddings before any truncation."""
    return config.dense[-1].weight.shape[0] if config.dense else hidden_size


def check_dimensions(params: PoolingParams, full_size: int, matryoshka: list[int] | None) -> None:
    """`dimensions` must fit the embedding (and be one of the model's Matryoshka sizes when
    its config lists them)."""
    d = params.dimensions
    if d is None:
        return
    if d > full_size:
        raise ValueError(f"dimensions={d} is larger than the model's embedding size {full_size}.")
    if matryoshka and d not in matryoshka:
        raise ValueError(f"dimensions={d} is not one of the model's matryoshka_dimensions {matryoshka}.")


def finish_embedding(vec: torch.Tensor, config: PoolerConfig, params: PoolingParams) -> torch.Tensor:
    """Dense layers, then truncation to `dimensions`, then normalisation (truncate, then
    normalise: sentence-transformers' `encode(truncate_dim=d, normalize_embeddings=True)`)."""
    vec = vec.float()
    for layer in config.dense:
        vec = layer(vec)
    dims = params.dimensions or config.dimensions
    if dims is not None:
        vec = vec[:dims]
    normalize = config.normalize if params.normalize is None else params.normalize
    if normalize:
        vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
    return vec


def classifier_output(logits: torch.Tensor, config: PoolerConfig, params: PoolingParams) -> torch.Tensor:
    """Probabilities from a classifier's logits: sigmoid for one label (a cross-encoder's
    relevance, as `CrossEncoder.predict`), softmax for several; raw with use_activation=False."""
    logits = logits.float()
    use = config.use_activation if params.use_activation is None else params.use_activation
    if not use:
        return logits
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)

"""The unit both pooling runners take: one tokenized request to run to a vector."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingWork:
    request_id: str
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # a cross-encoder's (query, document) segments
    arrival_time: float = 0.0

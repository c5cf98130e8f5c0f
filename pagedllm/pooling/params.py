"""PoolingParams: what a pooling request asks of the pooled vector, as vLLM spells it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# vLLM's pooling tasks: what the engine computes for a request.
POOLING_TASKS = ("embed", "classify", "score", "encode")


@dataclass
class PoolingParams:
    """`dimensions`: keep the first N values of the embedding (Matryoshka models), before
    normalisation, as sentence-transformers' `truncate_dim` does. `normalize`: L2-normalise
    the embedding (None: the model's pooler config decides). `truncate_prompt_tokens`: cut
    the prompt to this many tokens (-1: to the model's maximum length) instead of refusing a
    prompt that is too long. `use_activation`: classification / scores through softmax or
    sigmoid (None: yes). `task`: set by `LLM.embed` / `classify` / `score` / `encode`."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.dimensions is not None and (
                isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean, got {value!r}.")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {t!r}.")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}.")

    def clone(self, **changes) -> "PoolingParams":
        return dataclasses.replace(self, **changes)

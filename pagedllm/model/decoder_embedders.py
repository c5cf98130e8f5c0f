"""Decoders used as embedders (Qwen3-Embedding, e5-mistral, gte-Qwen2): the generation
model without its LM head. Their checkpoints are saved from `Qwen3Model` / `LlamaModel` ...,
so tensor names lack the `model.` prefix, and a head, if any, is not read."""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch

from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.qwen3 import Qwen3ForCausalLM


def _headless(base: type) -> type:
    class Headless(base):
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            config = copy.copy(config)
            config.tie_word_embeddings = True  # no head of its own: nothing to allocate or load
            super().__init__(config, *args, **kwargs)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            super().load_weights((name if name.startswith("model.") else f"model.{name}", tensor)
                                 for name, tensor in weights if name != "lm_head.weight")

    Headless.__name__ = Headless.__qualname__ = base.__name__.replace("ForCausalLM", "Model")
    Headless.__doc__ = f"{base.__name__} without its LM head: final hidden states for pooling."
    return Headless


LlamaModel = _headless(LlamaForCausalLM)
Qwen3Model = _headless(Qwen3ForCausalLM)

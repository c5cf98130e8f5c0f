"""A multimodal checkpoint as pagedllm runs it: pagedllm's own language model (the class its
`text_config` names, with every engine feature: paged KV, C kernels, TP, LoRA, quantization)
plus the architecture's vision encoder (transformers' modules, model/vision_encoders.py).

`multimodal_class(architecture, text_class)` makes the subclass: the text class's forward,
loading and sharding, with the checkpoint's language-model names mapped onto the text model's
(`model.language_model.*` / `language_model.model.*` -> `model.*`) and the vision tensors
handed to the encoder. The encoder is kept outside the module tree on purpose: the text
loader's completeness check, weight preparation, tensor-parallel slicing and LoRA walk the
module tree and must see only the language model (every rank runs the whole vision tower).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any

import torch

from pagedllm.model.vision_encoders import VisionEncoder, vision_encoder_class

_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("model.text_model.", "model."))


def text_name(name: str) -> str:
    """A checkpoint's language-model tensor name as the text model spells it."""
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class MultiModalMixin:
    """Placed before the text class in the MRO: adds the vision encoder, `embed_multimodal`,
    and the name mapping of loading and slicing."""

    config: Any
    dtype: torch.dtype
    multimodal_architecture: str = ""

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 **kwargs: Any) -> None:
        super().__init__(config, dtype=dtype, device=device, **kwargs)
        encoder = vision_encoder_class(self.multimodal_architecture)(config.multimodal_config)
        object.__setattr__(self, "vision", encoder.to(device=device, dtype=dtype).eval())

    @property
    def bidirectional_images(self) -> bool:
        """Whether prefill attends bidirectionally inside an image block (Gemma 3)."""
        return self.vision.bidirectional_images

    @property
    def mm_config(self) -> Any:
        return self.config.multimodal_config

    def checkpoint_slices(self, name: str, shape: tuple[int, ...] | None = None):
        if self.vision.checkpoint_key(name) is not None:
            return []  # every rank holds the whole vision tower
        return super().checkpoint_slices(text_name(name), shape)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision_state: dict[str, torch.Tensor] = {}
        encoder: VisionEncoder = self.vision

        def text_weights():
            for name, tensor in weights:
                key = encoder.checkpoint_key(name)
                if key is not None:
                    vision_state[key] = tensor
                else:
                    yield text_name(name), tensor

        super().load_weights(text_weights())
        encoder.load(vision_state)
        encoder.to(dtype=self.dtype)

    @torch.inference_mode()
    def embed_multimodal(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows `[rows, hidden]` (its processor tensors on the model's device)."""
        device = self.model.embed_tokens.weight.device if hasattr(self.model.embed_tokens, "weight") else "cpu"
        data = {k: (v.to(device=device, dtype=self.dtype) if v.is_floating_point() else v.to(device))
                for k, v in data.items()}
        return self.vision.embed(data).to(self.dtype)


@lru_cache(maxsize=None)
def multimodal_class(architecture: str, text_class: type) -> type:
    """`text_class` with `architecture`'s vision encoder (one class per pair, made once)."""
    return type(architecture, (MultiModalMixin, text_class), {"multimodal_architecture": architecture})


def is_multimodal(model: Any) -> bool:
    return isinstance(model, MultiModalMixin)

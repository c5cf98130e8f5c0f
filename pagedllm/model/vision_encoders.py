"""Vision towers of multimodal models: transformers' own modules (a well-kept implementation of
CLIP / SigLIP / Qwen2-VL's ViT beats a hand-written one), built from the checkpoint's config
and loaded from its tensors, beside pagedllm's own language model (model/multimodal.py).

An encoder turns one image's processor tensors (multimodal/inputs.py `MultiModalFeature.data`)
into the rows that replace its placeholder tokens: `[rows, text hidden size]`, in the order of
the placeholder positions.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

# HF architecture -> (module under pagedllm.model, encoder class), imported when asked for.
VISION_ENCODERS: dict[str, tuple[str, str]] = {
    "LlavaForConditionalGeneration": ("vision_encoders", "LlavaVisionEncoder"),
    "Qwen2VLForConditionalGeneration": ("vision_qwen2_vl", "Qwen2VLVisionEncoder"),
    "Qwen2_5_VLForConditionalGeneration": ("vision_qwen2_vl", "Qwen2_5_VLVisionEncoder"),
    "LlavaNextForConditionalGeneration": ("vision_llava_next", "LlavaNextVisionEncoder"),
    "Idefics3ForConditionalGeneration": ("vision_idefics3", "Idefics3VisionEncoder"),
    "SmolVLMForConditionalGeneration": ("vision_idefics3", "Idefics3VisionEncoder"),
    "Gemma3ForConditionalGeneration": ("vision_gemma3", "Gemma3VisionEncoder"),
}


def vision_encoder_class(architecture: str) -> type[VisionEncoder]:
    module, name = VISION_ENCODERS[architecture]
    return getattr(importlib.import_module(f"pagedllm.model.{module}"), name)


class VisionEncoder(nn.Module):
    """The vision parts of one architecture. Subclasses build `self.parts`: a transformers
    module holding exactly the checkpoint's vision tensors under their names without the
    `model.` prefix (`vision_tower.*`, `multi_modal_projector.*`, ...), and define `embed`."""

    parts: nn.Module
    # Whether the text model attends bidirectionally among one image block's tokens at prefill
    # (Gemma 3): the runner then marks the blocks in the attention metadata.
    bidirectional_images: bool = False

    def __init__(self, mm_config: Any) -> None:
        super().__init__()
        self.mm_config = mm_config

    def checkpoint_key(self, name: str) -> str | None:
        """The parts' key of checkpoint tensor `name`, or None when it is not a vision tensor
        (transformers 5 saves `model.vision_tower.*`, older checkpoints `vision_tower.*`)."""
        key = name.removeprefix("model.")
        return key if key.split(".", 1)[0] in self._top_names else None

    @property
    def _top_names(self) -> set[str]:
        names = self.__dict__.get("_top")
        if names is None:
            names = {k.split(".", 1)[0] for k in self.parts.state_dict()}
            self.__dict__["_top"] = names
        return names

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Load every vision tensor; a missing or unexpected one is a ValueError naming it."""
        expected = set(self.parts.state_dict())
        renamed = {}
        for key, tensor in state.items():
            # Hub checkpoints keep CLIP / SigLIP's `vision_model.` wrapper that transformers 5
            # drops (its conversion mapping's PrefixChange): accept both spellings.
            if key not in expected and ".vision_model." in key and key.replace(".vision_model.", ".", 1) in expected:
                key = key.replace(".vision_model.", ".", 1)
            renamed[key] = tensor
        missing, unexpected = self.parts.load_state_dict(renamed, strict=False)
        if missing or unexpected:
            raise ValueError(f"vision weights do not match the config: missing {sorted(missing)[:8]}, "
                             f"unexpected {sorted(unexpected)[:8]}")

    def embed(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


def build_parts(factory) -> nn.Module:
    """`factory()` without transformers' random initialisation (the weights are loaded next)."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        return factory()


def tower_and_projector(model_cls: type, pretrained_cls: type, projector_cls: type, mm_config: Any) -> nn.Module:
    """transformers' `model_cls` (LlavaModel, Gemma3Model, ...: its `get_image_features` works)
    holding only `vision_tower` and `multi_modal_projector`: the language model stays pagedllm's."""
    from transformers import AutoModel

    class Parts(model_cls):
        def __init__(self, config):
            pretrained_cls.__init__(self, config)
            self.vision_tower = AutoModel.from_config(config.vision_config)
            self.multi_modal_projector = projector_cls(config)

    return build_parts(lambda: Parts(mm_config))


class LlavaVisionEncoder(VisionEncoder):
    """LLaVA 1.5: CLIP's hidden states at `vision_feature_layer` (the CLS row dropped under the
    "default" strategy) through the two-layer projector: transformers' `get_image_features`."""

    def __init__(self, mm_config: Any) -> None:
        super().__init__(mm_config)
        from transformers.models.llava.modeling_llava import LlavaModel, LlavaMultiModalProjector, LlavaPreTrainedModel

        self.parts = tower_and_projector(LlavaModel, LlavaPreTrainedModel, LlavaMultiModalProjector, mm_config)

    def embed(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        cfg = self.mm_config
        out = self.parts.get_image_features(
            pixel_values=data["pixel_values"], vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy,
            **({"image_sizes": data["image_sizes"]} if "image_sizes" in data else {}))
        rows = out.pooler_output
        return torch.cat(list(rows), dim=0) if isinstance(rows, (list, tuple)) else rows.reshape(-1, rows.shape[-1])

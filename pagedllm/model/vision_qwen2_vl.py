"""Qwen2-VL's and Qwen2.5-VL's vision towers: transformers' own `visual` modules (the ViT with
2-D rotary, Qwen2.5's windowed attention, the 2x2 patch merger) and their `get_image_features`.

One image's processor tensors are its flattened patches (`pixel_values`, `t*h*w` rows) and its
`image_grid_thw` `[1, 3]`; its rows are `t*h*w / spatial_merge_size**2`, in the order of its
image tokens (dynamic resolution: every image its own grid).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.model.vision_encoders import VisionEncoder, build_parts


class _QwenVisionEncoder(VisionEncoder):
    """The checkpoint's `visual.*` tensors in a transformers `...VLModel` that builds only them."""

    def __init__(self, mm_config: Any) -> None:
        super().__init__(mm_config)
        model_cls, pretrained_cls, visual_cls = self.transformers_classes()

        class Parts(model_cls):
            def __init__(self, config):  # noqa: the language model stays pagedllm's
                pretrained_cls.__init__(self, config)
                self.visual = visual_cls._from_config(config.vision_config)

        self.parts = build_parts(lambda: Parts(mm_config))

    @staticmethod
    def transformers_classes() -> tuple[type, type, type]:
        """(the VL model class, its PreTrainedModel base, its vision transformer class)."""
        raise NotImplementedError

    def embed(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        grid = data.get("image_grid_thw")
        if grid is None or tuple(grid.shape) != (1, 3):
            raise ValueError(f"a Qwen2-VL image needs image_grid_thw of shape (1, 3), got "
                             f"{None if grid is None else tuple(grid.shape)}")
        out = self.parts.get_image_features(pixel_values=data["pixel_values"], image_grid_thw=grid)
        return out.pooler_output[0]


class Qwen2VLVisionEncoder(_QwenVisionEncoder):
    @staticmethod
    def transformers_classes() -> tuple[type, type, type]:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel,
            Qwen2VLModel,
            Qwen2VLPreTrainedModel,
        )

        return Qwen2VLModel, Qwen2VLPreTrainedModel, Qwen2VisionTransformerPretrainedModel


class Qwen2_5_VLVisionEncoder(_QwenVisionEncoder):
    @staticmethod
    def transformers_classes() -> tuple[type, type, type]:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
            Qwen2_5_VLModel,
            Qwen2_5_VLPreTrainedModel,
        )

        return Qwen2_5_VLModel, Qwen2_5_VLPreTrainedModel, Qwen2_5_VisionTransformerPretrainedModel

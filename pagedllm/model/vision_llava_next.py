"""LLaVA-NeXT's vision side (anyres): CLIP over the image's base crop and its grid tiles, the
projector, then transformers' `pack_image_features` (tiles unpadded to the image's aspect ratio,
one `image_newline` row after each feature row, the base crop's rows first). One image's rows
are exactly what `LlavaNextModel.get_image_features` gives for it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model.vision_encoders import LlavaVisionEncoder, VisionEncoder, build_parts


class LlavaNextVisionEncoder(LlavaVisionEncoder):
    """LLaVA 1.5's encoder call (`get_image_features` with the image's `image_sizes`) on
    LLaVA-NeXT's parts: the tower, the projector and the `image_newline` parameter."""

    def __init__(self, mm_config: Any) -> None:
        VisionEncoder.__init__(self, mm_config)  # not LLaVA 1.5's parts
        from transformers import AutoModel
        from transformers.models.llava_next.modeling_llava_next import (
            LlavaNextModel,
            LlavaNextMultiModalProjector,
            LlavaNextPreTrainedModel,
        )

        class LlavaNextParts(LlavaNextModel):
            def __init__(self, config):  # the language model stays pagedllm's
                LlavaNextPreTrainedModel.__init__(self, config)
                self.vision_tower = AutoModel.from_config(config.vision_config)
                self.multi_modal_projector = LlavaNextMultiModalProjector(config)
                self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size))

        self.parts = build_parts(lambda: LlavaNextParts(mm_config))

    def embed(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        if "image_sizes" not in data:
            raise ValueError("LLaVA-NeXT needs each image's `image_sizes` (its processor output) to pack its tiles")
        return super().embed(data)

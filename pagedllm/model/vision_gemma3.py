"""Gemma 3's vision side (`Gemma3ForConditionalGeneration`): transformers' SigLIP tower and
`Gemma3MultiModalProjector` (average-pooled to `mm_tokens_per_image` rows, RMS-normed,
projected to the text width), run through transformers' own `get_image_features`.

One image is its original plus its pan-and-scan crops (multimodal/image_spec_gemma3.py): the
rows of every crop in order, one placeholder run per crop. Gemma 3's image rows are not scaled
by sqrt(hidden) as its text embedding is (pagedllm's `embed_input_ids` scales; the image rows
replace those positions afterwards, as transformers' `masked_scatter` does).

Gemma 3 attends bidirectionally among the tokens of one image block during prefill
(`bidirectional_images`): the runner marks those spans in the attention metadata
(worker/mm_embeddings.py), the front end keeps an image in one prefill chunk.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.model.vision_encoders import VisionEncoder, tower_and_projector


class Gemma3VisionEncoder(VisionEncoder):
    bidirectional_images = True

    def __init__(self, mm_config: Any) -> None:
        super().__init__(mm_config)
        from transformers.models.gemma3.modeling_gemma3 import (
            Gemma3Model,
            Gemma3MultiModalProjector,
            Gemma3PreTrainedModel,
        )

        self.parts = tower_and_projector(Gemma3Model, Gemma3PreTrainedModel, Gemma3MultiModalProjector, mm_config)

    def embed(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """`pixel_values [1 + crops, 3, H, W]` -> `[(1 + crops) * mm_tokens_per_image, hidden]`."""
        pixels = data["pixel_values"]
        if pixels.dim() != 4:
            raise ValueError(f"Gemma 3 takes pixel_values [crops, 3, H, W], got shape {tuple(pixels.shape)}")
        rows = self.parts.get_image_features(pixel_values=pixels).pooler_output
        return rows.reshape(-1, rows.shape[-1])

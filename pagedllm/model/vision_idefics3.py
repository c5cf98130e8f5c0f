"""Idefics3 / SmolVLM's vision side: the SigLIP-style `vision_model` over each crop of an image
(its grid tiles and the global image; padded pixels masked by `pixel_attention_mask`), then the
`connector` (pixel shuffle, projection). One image's rows are its crops' rows in crop order, as
the prompt's runs of `<image>` (one run per crop) take them: transformers' `get_image_features`,
which also drops all-zero padding crops.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.model.vision_encoders import VisionEncoder, build_parts


def _parts_class(model_type: str) -> type:
    """The architecture's transformers model with only its vision parts built."""
    if model_type == "smolvlm":
        from transformers.models.smolvlm import modeling_smolvlm as m

        base, pretrained, tower, connector = (m.SmolVLMModel, m.SmolVLMPreTrainedModel, m.SmolVLMVisionTransformer,
                                              m.SmolVLMConnector)
    elif model_type == "idefics3":
        from transformers.models.idefics3 import modeling_idefics3 as m

        base, pretrained, tower, connector = (m.Idefics3Model, m.Idefics3PreTrainedModel,
                                              m.Idefics3VisionTransformer, m.Idefics3Connector)
    else:
        raise ValueError(f"an Idefics3-style vision encoder takes model_type 'idefics3' or 'smolvlm', got {model_type!r}")

    class Parts(base):
        def __init__(self, config):  # the language model (`text_model`) stays pagedllm's
            pretrained.__init__(self, config)
            self.vision_model = tower._from_config(config.vision_config)
            self.connector = connector(config)
            self.image_token_id = config.image_token_id

    Parts.__name__ = f"{base.__name__}VisionParts"
    return Parts


class Idefics3VisionEncoder(VisionEncoder):
    """`data`: one image's crops, `pixel_values` [1, crops, 3, H, W] and `pixel_attention_mask`
    [1, crops, H, W]; rows: crops x image_seq_len."""

    def __init__(self, mm_config: Any) -> None:
        super().__init__(mm_config)
        parts = _parts_class(mm_config.model_type)
        self.parts = build_parts(lambda: parts(mm_config))

    def embed(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels = data.get("pixel_values")
        if pixels is None or pixels.dim() != 5 or pixels.shape[0] != 1:
            shape = None if pixels is None else tuple(pixels.shape)
            raise ValueError(f"Idefics3 encodes one image's crops as pixel_values [1, crops, 3, H, W], got {shape}")
        out = self.parts.get_image_features(pixel_values=pixels,
                                            pixel_attention_mask=data.get("pixel_attention_mask"))
        return torch.cat(list(out.pooler_output), dim=0)

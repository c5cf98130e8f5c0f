"""LLaVA-NeXT's processor outputs per image: `pixel_values` is padded to the prompt's largest
tile count; each image keeps only its own tiles (the count anyres gives its `image_sizes`), so
that its content hash and its encoder input do not depend on the other images of the prompt."""

from __future__ import annotations

from typing import Any

from pagedllm.multimodal.image_specs import ImageSpec, register


@register("LlavaNextForConditionalGeneration")
class LlavaNextSpec(ImageSpec):
    """One image = one run of `<image>` (the packed rows, newlines included)."""

    def split_items(self, out: Any, num_images: int, mm_config: Any) -> list[dict[str, Any]]:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        items = super().split_items(out, num_images, mm_config)
        for i, item in enumerate(items):
            if "image_sizes" not in item or "pixel_values" not in item:
                raise ValueError(f"image {i}: LLaVA-NeXT's processor gave no `pixel_values` / `image_sizes`")
            tiles = image_size_to_num_patches(item["image_sizes"][0], mm_config.image_grid_pinpoints,
                                              mm_config.vision_config.image_size)
            if item["pixel_values"].shape[1] < tiles:
                raise ValueError(f"image {i}: {item['pixel_values'].shape[1]} tiles in `pixel_values`, anyres needs "
                                 f"{tiles} for its size {item['image_sizes'][0].tolist()}")
            item["pixel_values"] = item["pixel_values"][:, :tiles]
        return items

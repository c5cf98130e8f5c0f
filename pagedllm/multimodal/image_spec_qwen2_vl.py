"""Qwen2-VL and Qwen2.5-VL prompts: dynamic resolution (each image its own patch grid) and M-RoPE.

The processor flattens every image's patches into one `pixel_values` of `sum(t*h*w)` rows with
`image_grid_thw` `[num_images, 3]`: image i's rows are the next `t*h*w` of them, and its
`t*h*w / merge_size**2` image tokens are one run of `<|image_pad|>`. After the features are made,
each carries its tokens' 3-D rotary positions from transformers' `get_rope_index`
(multimodal/mrope.py).
"""

from __future__ import annotations

from typing import Any

from pagedllm.multimodal.image_specs import ImageSpec, register
from pagedllm.multimodal.mrope import prompt_positions, with_positions

class _QwenVLSpec(ImageSpec):
    architecture = ""

    def split_items(self, out: Any, num_images: int, mm_config: Any) -> list[dict[str, Any]]:
        grid, pixels = out.get("image_grid_thw"), out.get("pixel_values")
        if grid is None or pixels is None or grid.shape[0] != num_images:
            raise ValueError(f"the processor gave image_grid_thw for "
                             f"{None if grid is None else grid.shape[0]} images, not {num_images}")
        sizes = grid.prod(-1).tolist()
        if sum(sizes) != pixels.shape[0]:
            raise ValueError(f"pixel_values has {pixels.shape[0]} patch rows; image_grid_thw needs {sum(sizes)}")
        items, at = [], 0
        for i, n in enumerate(sizes):
            items.append({"pixel_values": pixels[at:at + n], "image_grid_thw": grid[i:i + 1]})
            at += n
        return items

    def finish(self, out: Any, features: list, mm_config: Any) -> list:
        positions, delta = prompt_positions(self.architecture, mm_config, out)
        return with_positions(features, positions, delta)


@register("Qwen2VLForConditionalGeneration")
class Qwen2VLSpec(_QwenVLSpec):
    architecture = "Qwen2VLForConditionalGeneration"


@register("Qwen2_5_VLForConditionalGeneration")
class Qwen2_5_VLSpec(_QwenVLSpec):
    architecture = "Qwen2_5_VLForConditionalGeneration"

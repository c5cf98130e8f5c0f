"""Gemma 3's processing (`Gemma3ForConditionalGeneration`, transformers' `Gemma3Processor`).

An image is `\\n\\n<start_of_image>` + `mm_tokens_per_image` soft tokens + `<end_of_image>\\n\\n`;
with pan-and-scan (`do_pan_and_scan`, a processor option: `mm_processor_kwargs` or the saved
processor config) it is its original and its crops, each such block, with text between: one
image, `1 + num_crops` placeholder runs and pixel rows (original first, then the crops, in
the order of the runs).

The processor drops `num_crops` from its outputs (`Gemma3Processor.unused_input_names`), so the
count is recomputed per image by the image processor's own `pan_and_scan` on the image's size
(as vLLM does), with the options the processor call used, and checked against the pixel rows.

Gemma 3 attends bidirectionally inside an image block at prefill (transformers'
`token_type_ids` mask): an image must be computed in one prefill chunk.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.multimodal.image_specs import ImageSpec, register


def num_crops(processor: Any, images: list) -> list[int]:
    """Each image's pan-and-scan crop count under the processor's effective image options."""
    options = processor._merge_kwargs(tokenizer_init_kwargs=processor.tokenizer.init_kwargs)["images_kwargs"]
    image_processor = processor.image_processor

    def option(name: str) -> Any:
        value = options.get(name)
        return getattr(image_processor, name, None) if value is None else value

    if not option("do_pan_and_scan"):
        return [0] * len(images)
    counts = []
    for im in images:
        # pan_and_scan reads the size of a channels-first array and slices it: a zero-stride
        # view of the right shape stands in for the pixels.
        view = np.broadcast_to(np.zeros((1, 1, 1), dtype=np.uint8), (1, im.height, im.width))
        crops = image_processor.pan_and_scan(view, option("pan_and_scan_min_crop_size"),
                                             option("pan_and_scan_max_num_crops"),
                                             option("pan_and_scan_min_ratio_to_activate"))
        counts.append(len(crops))
    return counts


@register("Gemma3ForConditionalGeneration")
class Gemma3Spec(ImageSpec):
    whole_in_one_chunk = True

    def call_processor(self, processor: Any, text: str, images: list) -> Any:
        out = processor(text=[text], images=images or None, return_tensors="pt")
        if images:
            out["num_crops"] = torch.tensor(num_crops(processor, images), dtype=torch.long)
        return out

    def split_items(self, out: Any, num_images: int, mm_config: Any) -> list[dict[str, Any]]:
        crops = out["num_crops"].tolist()
        pixels = out["pixel_values"]
        if len(crops) != num_images or pixels.shape[0] != num_images + sum(crops):
            raise ValueError(f"Gemma 3's processor gave {pixels.shape[0]} pixel rows for {num_images} image(s) "
                             f"with {crops} pan-and-scan crops")
        items, at = [], 0
        for n in crops:
            items.append({"pixel_values": pixels[at:at + 1 + n]})
            at += 1 + n
        return items

    def runs_per_item(self, item: dict[str, Any], mm_config: Any) -> int:
        return int(item["pixel_values"].shape[0])

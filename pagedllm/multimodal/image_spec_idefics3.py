"""Idefics3 / SmolVLM's processor outputs per image. With image splitting one image becomes
rows x cols crops plus its global image, each crop its own run of `<image>` between text tokens
(`<fake_token_around_image>`, `<row_i_col_j>`, `<global-img>`), so an image fills one run per
crop; a prompt's crops of all its images are stacked in `pixel_values` [1, crops, 3, H, W] in
prompt order. Which crops are whose is read off the expanded ids: an image's runs end with the
run after `<global-img>`."""

from __future__ import annotations

from typing import Any

from pagedllm.multimodal.image_specs import ImageSpec, register

_CROPS = "_crops_per_image"  # put on the processor's output by call_processor, taken by split_items
_CROP_KEYS = ("pixel_values", "pixel_attention_mask")


def crops_per_image(ids: list[int], image_token_id: int, global_token_id: int) -> list[int]:
    """The number of `<image>` runs of each image: runs counted up to and including each run
    that follows `<global-img>`."""
    counts: list[int] = []
    n = 0
    for i, t in enumerate(ids):
        if t == image_token_id and (i == 0 or ids[i - 1] != image_token_id):
            n += 1
            if i > 0 and ids[i - 1] == global_token_id:
                counts.append(n)
                n = 0
    if n:
        raise ValueError(f"{n} image placeholder run(s) after the last <global-img> run belong to no image")
    return counts


@register("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
class Idefics3Spec(ImageSpec):
    def call_processor(self, processor: Any, text: str, images: list) -> Any:
        out = super().call_processor(processor, text, images)
        if images:
            global_tag = getattr(processor, "global_image_tag", None) or getattr(processor, "global_image_token")
            ids = out["input_ids"][0].tolist()
            out[_CROPS] = crops_per_image(ids, processor.image_token_id,
                                          processor.tokenizer.convert_tokens_to_ids(global_tag))
        return out

    def split_items(self, out: Any, num_images: int, mm_config: Any) -> list[dict[str, Any]]:
        crops = out.pop(_CROPS, None)
        if crops is None or len(crops) != num_images:
            found = "none" if crops is None else len(crops)
            raise ValueError(f"the prompt's expanded ids have {found} images' crop runs for {num_images} image(s)")
        items: list[dict[str, Any]] = [{} for _ in range(num_images)]
        for key in _CROP_KEYS:
            value = out.get(key)
            if value is None:
                continue
            if value.shape[0] != 1 or value.shape[1] < sum(crops):
                raise ValueError(f"processor output {key!r} of shape {tuple(value.shape)} does not hold the "
                                 f"prompt's {sum(crops)} crops")
            at = 0
            for i, n in enumerate(crops):  # padding crops past the last image's are no image's
                items[i][key] = value[:, at:at + n]
                at += n
        if any("pixel_values" not in item for item in items):
            raise ValueError("Idefics3's processor gave no `pixel_values`")
        return items

    def runs_per_item(self, item: dict[str, Any], mm_config: Any) -> int:
        return int(item["pixel_values"].shape[1])

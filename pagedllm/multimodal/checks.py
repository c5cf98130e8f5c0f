"""The core's check of a request's images (a request from another process is not trusted):
placeholder runs inside the prompt, in order, not overlapping, rows the encoder cache and a
step can hold. A ValueError names what is wrong, before the request holds anything."""

from __future__ import annotations

from typing import Any

from pagedllm.multimodal.inputs import content_hash


def check_mm_features(features: list[Any] | None, prompt_len: int, takes_images: bool, encoder_cache: Any,
                      max_num_batched_tokens: int, model_name: str) -> None:
    if not features:
        return
    if not takes_images:
        raise ValueError(f"{model_name} takes text only: a request with images cannot run on it.")
    end = 0
    for i, f in enumerate(features):
        if f.modality != "image":
            raise ValueError(f"image {i}: modality {f.modality!r} is not supported (images only)")
        if f.content_hash != content_hash(f.modality, f.data):
            # The hash keys the encoder cache and prefix-cache blocks other requests share:
            # never trusted from a request (a forged one could serve its rows to another image).
            raise ValueError(f"image {i}: its content hash does not match its data")
        if not f.runs:
            raise ValueError(f"image {i} has no placeholder positions")
        for r in f.runs:
            if r.length < 1 or r.offset < end or r.offset + r.length > prompt_len:
                raise ValueError(f"image {i}: placeholder run at {r.offset} (+{r.length}) is out of order or outside "
                                 f"the prompt of {prompt_len} tokens")
            end = r.offset + r.length
        encoder_cache.check_item_fits(f.num_rows)
        if f.whole_in_one_chunk and f.end - f.start > max_num_batched_tokens:
            raise ValueError(f"image {i} spans {f.end - f.start} prompt tokens, which this model computes in one "
                             f"step; max_num_batched_tokens is {max_num_batched_tokens}.")

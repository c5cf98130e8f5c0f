"""A prompt with images -> token ids with each image's placeholder expanded, and one
`MultiModalFeature` per image: the model's own transformers processor (`AutoProcessor`) does
the image processing and the expansion, in the front end (as in vLLM), so the core only ever
sees token ids and tensors.

Which processor outputs belong to which image, and how many placeholder runs an image fills,
differ per architecture (`multimodal/image_specs.py`); everything else is shared here.
"""

from __future__ import annotations

import threading
from functools import cached_property
from typing import Any

from pagedllm.multimodal.image_specs import ImageSpec, image_spec_for
from pagedllm.multimodal.inputs import MultiModalFeature, PlaceholderRun, TensorData, content_hash
from pagedllm.multimodal.limits import NOT_SUPPORTED, REFUSED_MODALITIES, SUPPORTED_MODALITIES, check_image_count


def placeholder_runs(token_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """Maximal runs of `token_id` in `token_ids`, as (offset, length)."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate(token_ids):
        if t == token_id:
            if start is None:
                start = i
        elif start is not None:
            runs.append((start, i - start))
            start = None
    if start is not None:
        runs.append((start, len(token_ids) - start))
    return runs


def images_of(mm_data: Any) -> list[Any]:
    """The images of a prompt's `multi_modal_data` ({"image": image | [images]}); other
    modalities and malformed values are a ValueError naming them."""
    if not isinstance(mm_data, dict):
        raise ValueError(f"multi_modal_data must be a dict like {{'image': [...]}}, got {type(mm_data).__name__}.")
    for key in mm_data:
        if key in REFUSED_MODALITIES:
            raise ValueError(f"multi_modal_data[{key!r}]: {key} inputs are not supported: {NOT_SUPPORTED}.")
        if key not in SUPPORTED_MODALITIES:
            raise ValueError(f"multi_modal_data has an unknown modality {key!r}; pagedllm takes "
                             f"{', '.join(SUPPORTED_MODALITIES)}.")
    images = mm_data.get("image", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    from PIL import Image

    for i, im in enumerate(images):
        if not isinstance(im, Image.Image):
            raise ValueError(f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, got {type(im).__name__}.")
    return images


class MultiModalProcessor:
    """The front end's image processing for one multimodal model."""

    def __init__(self, model_path: str, mm_config: Any, architecture: str, limits: dict[str, int] | None = None,
                 processor_kwargs: dict[str, Any] | None = None) -> None:
        self.model_path = model_path
        self.mm_config = mm_config
        self.spec: ImageSpec = image_spec_for(architecture)
        self.limits = limits  # limit_mm_per_prompt (multimodal/limits.py)
        self.processor_kwargs = dict(processor_kwargs or {})
        self._lock = threading.Lock()  # a processor is not documented thread-safe

    @cached_property
    def processor(self):
        return self.spec.load_processor(self.model_path, **self.processor_kwargs)

    @cached_property
    def image_token_id(self) -> int:
        return self.spec.image_token_id(self.mm_config, self.processor)

    def process(self, text: str, mm_data: Any) -> tuple[list[int], list[MultiModalFeature]]:
        """(token ids, features) of `text` with `multi_modal_data`; a ValueError names what is
        wrong (too many images, placeholders that do not match the images, a processor error)."""
        images = images_of(mm_data)
        check_image_count(len(images), self.limits)
        with self._lock:
            try:
                out = self.spec.call_processor(self.processor, text, images)
            except (ValueError, TypeError, IndexError) as exc:
                raise ValueError(f"The model's processor refused the prompt and its {len(images)} image(s): {exc}") from None
        ids = [int(t) for t in out["input_ids"][0].tolist()]
        if not images:
            if self.image_token_id in ids:
                raise ValueError("The prompt holds the model's image placeholder but no image was given.")
            return ids, []
        return ids, self.spec.finish(out, self.features(ids, out, len(images)), self.mm_config)

    def features(self, ids: list[int], out: Any, num_images: int) -> list[MultiModalFeature]:
        runs = placeholder_runs(ids, self.image_token_id)
        items = self.spec.split_items(out, num_images, self.mm_config)
        features: list[MultiModalFeature] = []
        at = 0
        for i, item in enumerate(items):
            n = self.spec.runs_per_item(item, self.mm_config)
            mine = runs[at:at + n]
            if len(mine) != n:
                raise ValueError(f"The prompt has {len(runs)} image placeholder runs; image {i} needs {n} more "
                                 f"(each image needs its placeholder, {self.processor_placeholder!r}, in the prompt).")
            at += n
            data = {k: TensorData.from_torch(v) for k, v in item.items()}
            row = 0
            placed = []
            for offset, length in mine:
                placed.append(PlaceholderRun(offset, length, row))
                row += length
            features.append(MultiModalFeature("image", content_hash("image", data), placed, data,
                                              self.spec.whole_in_one_chunk))
        if at != len(runs):
            raise ValueError(f"The prompt has {len(runs)} image placeholder runs for {num_images} image(s): "
                             "one placeholder per image.")
        return features

    @property
    def processor_placeholder(self) -> str:
        return getattr(self.processor, "image_token", "<image>")


def multimodal_processor(config: Any, source: Any) -> MultiModalProcessor | None:
    """The front end's processor for the engine's model, or None for a text-only model. Reads
    config.json as JSON first (a text model costs no transformers import here)."""
    import json
    import os

    from pagedllm.model import registry

    if getattr(source, "is_gguf", False) or not os.path.isfile(os.path.join(source.path, "config.json")):
        return None
    with open(os.path.join(source.path, "config.json"), encoding="utf-8") as f:
        archs = json.load(f).get("architectures") or []
    arch = next((a for a in archs if a in registry.MULTIMODAL_ARCHS), None)
    if arch is None:
        return None
    from transformers import AutoConfig

    return MultiModalProcessor(source.path, AutoConfig.from_pretrained(source.path), arch,
                               limits=getattr(config, "limit_mm_per_prompt", None),
                               processor_kwargs=getattr(config, "mm_processor_kwargs", None))

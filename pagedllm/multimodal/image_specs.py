"""Per architecture, what the shared processing (multimodal/processing.py) cannot know: how to
call the model's processor, which of its outputs belong to which image, how many placeholder
runs one image fills, the placeholder token, and whether an image must be prefilled in one
chunk. The vision towers themselves are the models' business (model/vision_encoders.py).
"""

from __future__ import annotations

from typing import Any


class ImageSpec:
    """The default: one image = one run of the image token; per-image tensors are the rows of
    every batched processor output whose first dimension is the number of images."""

    whole_in_one_chunk = False
    # Processor outputs that describe the text, not the images.
    text_keys = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")

    def load_processor(self, model_path: str, **kwargs: Any) -> Any:
        """The model's processor; without torchvision, its class without the video processor
        (transformers 5 builds Qwen2-VL's and SmolVLM's only with one, and video processors
        need torchvision, which images never touch)."""
        import transformers
        from transformers.utils import is_torchvision_available

        cls = None if is_torchvision_available() else processor_class_of(model_path)
        if cls is None or "video_processor" not in cls.get_attributes():
            return transformers.AutoProcessor.from_pretrained(model_path, **kwargs)
        return image_only(cls).from_pretrained(model_path, **kwargs)

    def call_processor(self, processor: Any, text: str, images: list) -> Any:
        return processor(text=[text], images=images or None, return_tensors="pt")

    def image_token_id(self, mm_config: Any, processor: Any) -> int:
        for name in ("image_token_id", "image_token_index"):
            value = getattr(mm_config, name, None)
            if value is not None:
                return int(value)
        return int(processor.image_token_id)

    def split_items(self, out: Any, num_images: int, mm_config: Any) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = [{} for _ in range(num_images)]
        for key, value in out.items():
            if key in self.text_keys or not hasattr(value, "shape"):
                continue
            if value.shape[0] != num_images:
                raise ValueError(f"processor output {key!r} has {value.shape[0]} rows for {num_images} images")
            for i in range(num_images):
                items[i][key] = value[i:i + 1]
        return items

    def runs_per_item(self, item: dict[str, Any], mm_config: Any) -> int:
        return 1

    def finish(self, out: Any, features: list, mm_config: Any) -> list:
        """The prompt's features with what the model needs beyond its images' tensors (M-RoPE
        positions: multimodal/image_spec_qwen2_vl.py); as they are by default."""
        return features


def processor_class_of(model_path: str) -> type | None:
    """The transformers processor class a folder names (processor_config.json, else
    preprocessor_config.json / tokenizer_config.json), or None."""
    import json
    import os

    import transformers

    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = os.path.join(model_path, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                cls = getattr(transformers, json.load(f).get("processor_class") or "", None)
            if cls is not None:
                return cls
    return None


def image_only(cls: type) -> type:
    """`cls` (a processor class) without its video processor, under the same name."""
    attrs = [a for a in cls.get_attributes() if a != "video_processor"]
    return type(cls.__name__, (cls,), {"get_attributes": classmethod(lambda _: list(attrs)),
                                       "__module__": cls.__module__, "__doc__": cls.__doc__})


# HF architecture -> its spec (architectures absent here use the default).
_SPECS: dict[str, ImageSpec] = {}


def register(*architectures: str):
    def wrap(cls: type[ImageSpec]) -> type[ImageSpec]:
        for arch in architectures:
            _SPECS[arch] = cls()
        return cls
    return wrap


_DEFAULT = ImageSpec()


# Modules with the specs of further architectures (they register when imported).
SPEC_MODULES = ("pagedllm.multimodal.image_spec_qwen2_vl", "pagedllm.multimodal.image_spec_idefics3",
                "pagedllm.multimodal.image_spec_llava_next", "pagedllm.multimodal.image_spec_gemma3")


def image_spec_for(architecture: str) -> ImageSpec:
    import importlib

    for name in SPEC_MODULES:
        importlib.import_module(name)
    return _SPECS.get(architecture, _DEFAULT)


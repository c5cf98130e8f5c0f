"""What the front end needs to know of a multimodal model without loading it: whether it takes
images, and the chat template its processor keeps.

A multimodal folder may keep its chat template with the processor, not the tokenizer:
`chat_template.jinja` (which transformers' tokenizer reads too), the legacy
`chat_template.json` (`{"chat_template": ...}`, read by the processor only) or
`processor_config.json`'s `chat_template`. `processor_chat_template` reads those files as
`ProcessorMixin.from_pretrained` does, without building the image processor.
"""

from __future__ import annotations

import json
import os
from typing import Any

CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "processor_config.json")


def takes_images(hf_config: Any) -> bool:
    """A transformers config (or config.json as a dict) of a model with a vision tower."""
    if hf_config is None:
        return False
    if isinstance(hf_config, dict):
        return hf_config.get("vision_config") is not None
    return getattr(hf_config, "vision_config", None) is not None


def folder_takes_images(folder: str | None) -> bool:
    """`takes_images` from a model folder's config.json (False for a GGUF file or no folder)."""
    if not folder or not os.path.isdir(folder):
        return False
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            return takes_images(json.load(f))
    except (OSError, ValueError):
        return False


def _template_of(value: Any) -> str | None:
    """A template string, or the default of transformers' named-template list form."""
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        found = named.get("default")
        return found if isinstance(found, str) and found.strip() else None
    return None


def processor_chat_template(folder: str | os.PathLike | None) -> str | None:
    """The processor's chat template kept in `folder`, or None."""
    if folder is None or not os.path.isdir(folder):
        return None
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            text = f.read()
        if text.strip():
            return text
    for name in ("chat_template.json", "processor_config.json"):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        found = _template_of(data.get("chat_template")) if isinstance(data, dict) else None
        if found is not None:
            return found
    return None

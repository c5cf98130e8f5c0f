"""OpenAI chat content parts -> the messages a chat template reads, plus the images in order.

Parts taken: `text`, `refusal` (an assistant's, as text), `image_url` (`{"url", "detail"}`,
OpenAI's shape) and, offline only, vLLM's `image_pil` (a PIL image). Every other part type
(`input_audio`, `audio_url`, `video_url`, `file`, ...) is refused by name. A model that takes
images gets every message's content as a list in transformers' chat-template form,
`[{"type": "image"}, {"type": "text", "text": ...}]` in the order of the parts (multimodal
templates iterate over the content; some read no plain string); a text model gets strings, its
text parts joined by newlines, and any image part is refused. The image count is checked
against `limit_mm_per_prompt` here, before anything is fetched. No I/O: `load_images` fetches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.multimodal.limits import NOT_SUPPORTED, check_image_count

IMAGE_PART_TYPES = ("image_url", "image_pil")
TEXT_PART_TYPES = ("text", "refusal")


@dataclass(frozen=True)
class ImageRef:
    """One image of a conversation: a URL to load (`image_url`) or a PIL image (`image_pil`)."""

    url: str | None = None
    image: Any = None  # PIL.Image.Image
    detail: str | None = None  # OpenAI's "auto" / "low" / "high"; the processor decides the size


@dataclass
class ChatInputs:
    """A conversation as the template reads it, and its images in prompt order."""

    messages: list[dict[str, Any]]
    images: list[ImageRef] = field(default_factory=list)


def _part_dict(part: Any) -> dict[str, Any]:
    if isinstance(part, dict):
        return part
    dump = getattr(part, "model_dump", None)  # the server's pydantic parts
    if dump is not None:
        return dump(exclude_none=True)
    raise ValueError(f"A content part must be an object with a `type`, got {type(part).__name__}.")


def _image_ref(kind: str, part: dict[str, Any], where: str, allow_pil: bool) -> ImageRef:
    if kind == "image_pil":
        if not allow_pil:
            raise ValueError(f"{where}: content parts of type 'image_pil' are offline only "
                             "(LLM.chat); send an 'image_url' part.")
        from PIL import Image

        img = part.get("image_pil")
        if not isinstance(img, Image.Image):
            raise ValueError(f"{where}: an 'image_pil' part needs a PIL.Image under 'image_pil', got "
                             f"{type(img).__name__}.")
        return ImageRef(image=img)
    spec = part.get("image_url")
    if isinstance(spec, str):  # vLLM's lenient form {"type": "image_url", "image_url": "..."}
        spec = {"url": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str) or not spec["url"].strip():
        raise ValueError(f"{where}: an 'image_url' part needs {{'image_url': {{'url': ...}}}} with a "
                         "non-empty url.")
    detail = spec.get("detail")
    if detail is not None and detail not in ("auto", "low", "high"):
        raise ValueError(f"{where}: image_url.detail must be 'auto', 'low' or 'high', got {detail!r}.")
    return ImageRef(url=spec["url"], detail=detail)


def parse_content(content: Any, where: str, takes_images: bool, allow_pil: bool = False,
                  model_name: str = "this model") -> tuple[str | list[dict[str, Any]], list[ImageRef]]:
    """One message's content in template form and its images; `where` names it in errors."""
    if content is None:
        return ([] if takes_images else ""), []
    if isinstance(content, str):
        return ([{"type": "text", "text": content}] if takes_images else content), []
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where}.content must be a string or a list of content parts, got "
                         f"{type(content).__name__}.")
    parts: list[dict[str, Any]] = []
    texts: list[str] = []
    images: list[ImageRef] = []
    for i, raw in enumerate(content):
        part = _part_dict(raw)
        kind = part.get("type")
        at = f"{where}.content[{i}]"
        if kind in TEXT_PART_TYPES:
            text = part.get(kind)
            if not isinstance(text, str):
                raise ValueError(f"{at}: a {kind!r} part needs a string under {kind!r}.")
            texts.append(text)
            parts.append({"type": "text", "text": text})
        elif kind in IMAGE_PART_TYPES:
            if not takes_images:
                raise ValueError(f"{at}: content parts of type {kind!r} are not supported: "
                                 f"{model_name} takes text only (parts of type 'text').")
            images.append(_image_ref(kind, part, at, allow_pil))
            parts.append({"type": "image"})
        else:
            raise ValueError(f"{at}: content parts of type {kind!r} are not supported: "
                             f"{NOT_SUPPORTED} (parts of type 'text' and 'image_url').")
    return (parts if takes_images else "\n".join(texts)), images


def parse_conversation(messages: list[Any], takes_images: bool, limits: dict[str, int] | None = None,
                       allow_pil: bool = False, model_name: str = "this model") -> ChatInputs:
    """Template messages (a copy of each message with its content converted) and the images.

    `messages`: OpenAI-shaped dicts (offline) or dicts from the server's models; every field
    other than `content` is kept as is. ValueError for refused parts and too many images."""
    out: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got "
                             f"{type(msg).__name__}.")
        content, found = parse_content(msg.get("content"), f"messages[{i}]", takes_images,
                                       allow_pil, model_name)
        out.append({**msg, "content": content})
        images.extend(found)
    check_image_count(len(images), limits)
    return ChatInputs(out, images)


def load_images(refs: list[ImageRef], policy: Any) -> list[Any]:
    """The RGB images of `refs`, in order (blocking: remote URLs are fetched). An `image_pil`
    part is checked against the pixel cap and converted to RGB like a decoded one."""
    from pagedllm.multimodal.media import load_image_url, to_rgb

    out = []
    for ref in refs:
        if ref.url is not None:
            out.append(load_image_url(ref.url, policy))
            continue
        width, height = ref.image.size
        if width * height > policy.max_image_pixels:
            raise ValueError(f"image_pil: {width}x{height} = {width * height} pixels, more than the "
                             f"limit of {policy.max_image_pixels} (max_image_pixels).")
        out.append(to_rgb(ref.image))
    return out


def multimodal_prompt(text: str, images: list[Any]) -> dict[str, Any]:
    """The engine's prompt dict for a rendered conversation with images (the processor
    expands the template's image placeholders into the image tokens)."""
    return {"prompt": text, "multi_modal_data": {"image": list(images)}}

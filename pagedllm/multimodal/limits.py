"""`limit_mm_per_prompt` (vLLM's `--limit-mm-per-prompt '{"image": 4}'`) and the media
knobs' defaults, without PIL or httpx: `EngineConfig.validate` reads this module."""

from __future__ import annotations

import json
import os
from typing import Any

# vLLM (V1): 999 items per modality unless limit_mm_per_prompt says otherwise.
DEFAULT_IMAGE_LIMIT = 999
SUPPORTED_MODALITIES = ("image",)
REFUSED_MODALITIES = ("video", "audio")
NOT_SUPPORTED = "pagedllm takes text and images"

DEFAULT_MEDIA_FETCH_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


def parse_limit_mm_per_prompt(value: Any) -> dict[str, int]:
    """The limits as a dict {"image": n}; accepts a dict, its JSON, or vLLM's older
    `image=4` form. None: {} (the default limit). A modality other than "image" is refused by
    name: a limit for video would promise inputs pagedllm does not take."""
    if value is None:
        return {}
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"limit_mm_per_prompt is not valid JSON ({exc}); expected e.g. "
                                 "'{\"image\": 4}'.") from None
        else:  # vLLM's older "image=4,video=1"
            pairs = [p for p in text.split(",") if p.strip()]
            parsed: dict[str, Any] = {}
            for pair in pairs:
                key, sep, num = pair.partition("=")
                if not sep:
                    raise ValueError(f"limit_mm_per_prompt {value!r}: expected JSON such as "
                                     "'{\"image\": 4}' (or image=4).")
                try:
                    parsed[key.strip()] = int(num)
                except ValueError:
                    raise ValueError(f"limit_mm_per_prompt {value!r}: {num.strip()!r} is not an "
                                     "integer.") from None
            value = parsed
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt must be a dict such as {{'image': 4}} (or its JSON), "
                         f"got {type(value).__name__}.")
    out: dict[str, int] = {}
    for key, limit in value.items():
        if key in REFUSED_MODALITIES:
            raise ValueError(f"limit_mm_per_prompt[{key!r}]: {key} inputs are not supported: "
                             f"{NOT_SUPPORTED}.")
        if key not in SUPPORTED_MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {key!r}; supported: "
                             f"{list(SUPPORTED_MODALITIES)} ({NOT_SUPPORTED}).")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit_mm_per_prompt[{key!r}] must be an integer >= 0, got {limit!r}.")
        out[key] = limit
    return out


def image_limit(limits: dict[str, int] | None) -> int:
    """Most images one prompt may carry."""
    return (limits or {}).get("image", DEFAULT_IMAGE_LIMIT)


def check_image_count(count: int, limits: dict[str, int] | None) -> None:
    """ValueError (a 400 in the server) when a prompt carries more images than allowed."""
    limit = image_limit(limits)
    if count > limit:
        raise ValueError(f"At most {limit} image(s) may be provided in one prompt, got {count} "
                         "(limit_mm_per_prompt / --limit-mm-per-prompt).")


def check_media_knobs(allowed_local_media_path: str, allowed_media_domains: Any,
                      media_fetch_timeout: Any, max_image_bytes: Any, max_image_pixels: Any) -> list[str] | None:
    """Validate the media knobs (EngineConfig); returns the domains normalized (lower case,
    no trailing dot) or None."""
    if allowed_local_media_path:
        if not isinstance(allowed_local_media_path, str):
            raise ValueError(f"allowed_local_media_path must be a folder path, got {allowed_local_media_path!r}.")
        if not os.path.isdir(allowed_local_media_path):
            raise ValueError(f"allowed_local_media_path {allowed_local_media_path!r} is not an existing folder.")
    domains = allowed_media_domains
    if domains is not None:
        if isinstance(domains, str):
            domains = [domains]
        if not isinstance(domains, (list, tuple, set, frozenset)) or \
                not all(isinstance(d, str) and d.strip() for d in domains):
            raise ValueError(f"allowed_media_domains must be a list of host names, got {allowed_media_domains!r}.")
        domains = [normalize_host(d) for d in domains]
        bad = [d for d in domains if "/" in d or ":" in d or "@" in d]
        if bad:
            raise ValueError(f"allowed_media_domains takes host names (example.com), not URLs or "
                             f"host:port; got {bad}.")
    t = media_fetch_timeout
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
        raise ValueError(f"media_fetch_timeout must be a positive number of seconds, got {t!r}.")
    for name, v in (("max_image_bytes", max_image_bytes), ("max_image_pixels", max_image_pixels)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}.")
    return domains


def normalize_host(host: str) -> str:
    return host.strip().lower().rstrip(".")


def parse_mm_processor_kwargs(value: Any) -> dict[str, Any] | None:
    """vLLM's `mm_processor_kwargs`: a dict of the processor's settings, or its JSON; None: none."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"mm_processor_kwargs is not valid JSON ({exc}); expected e.g. "
                             "'{\"do_pan_and_scan\": true}'.") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"mm_processor_kwargs must be a dict of setting names to values (or its JSON), got {value!r}.")
    return dict(value)

"""Images from OpenAI-style URLs, under the server's media policy (vLLM's flags).

`data:image/...;base64,` URLs are decoded in place; `http(s)://` URLs are fetched only from hosts
in `--allowed-media-domains` (none by default: a remote URL is refused), within
`--media-fetch-timeout` and `--max-image-bytes` (media_http.py); `file://` URLs are read only
under `--allowed-local-media-path` (off by default), symlinks and `..` resolved first.
Decoding takes the formats in `SUPPORTED_IMAGE_FORMATS` only (PIL has decoders, such as EPS
through Ghostscript, that no request should reach), checks the pixel count from the header
before any pixel is decoded (`--max-image-pixels`, against decompression bombs), applies the
EXIF orientation and converts to RGB (transparency over white, as vLLM). Every refusal is a
ValueError naming the flag or the reason: a 400 in the server.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

from pagedllm.multimodal.limits import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MEDIA_FETCH_TIMEOUT_S,
)
from pagedllm.multimodal.urls import show_url

if TYPE_CHECKING:
    from PIL import Image

# What a request's image may be; PIL is never asked to identify anything else.
SUPPORTED_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be (EngineConfig's media knobs)."""

    allowed_media_domains: frozenset[str] = frozenset()  # empty: every remote URL refused
    allowed_local_media_path: str | None = None  # resolved folder; None: file:// refused
    fetch_timeout_s: float = DEFAULT_MEDIA_FETCH_TIMEOUT_S
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_redirects: int = 5  # each hop checked against the allow-list

    @classmethod
    def from_config(cls, config: Any) -> MediaPolicy:
        """From an EngineConfig (validated: the domains normalized, the folder existing)."""
        root = config.allowed_local_media_path or None
        return cls(
            allowed_media_domains=frozenset(config.allowed_media_domains or ()),
            allowed_local_media_path=os.path.realpath(root) if root else None,
            fetch_timeout_s=float(config.media_fetch_timeout),
            max_image_bytes=config.max_image_bytes,
            max_image_pixels=config.max_image_pixels,
        )


def load_image_url(url: str, policy: MediaPolicy) -> Image.Image:
    """The RGB image an OpenAI `image_url.url` names (blocking: fetches remote URLs)."""
    return decode_image(read_image_url(url, policy), policy, show_url(url))


def read_image_url(url: str, policy: MediaPolicy) -> bytes:
    """The encoded bytes behind a data:, http(s):// or file:// URL, under `policy`."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("An image_url needs a non-empty `url` (data:, http(s):// or file://).")
    url = url.strip()
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _read_data_url(url, policy)
    if scheme in ("http", "https"):
        from pagedllm.multimodal.media_http import fetch_bytes  # lazy: httpx

        return fetch_bytes(url, policy)
    if scheme == "file":
        return _read_file_url(url, policy)
    raise ValueError(f"Image URL {show_url(url)!r}: unsupported scheme {scheme or '(none)'!r}; "
                     "use a data:image/...;base64 URL, http(s):// or file://.")


def _read_data_url(url: str, policy: MediaPolicy) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ValueError(f"Image URL {show_url(url)!r}: a data URL needs a ',' before its data.")
    media_type, *params = header[5:].split(";")
    media_type = media_type.strip().lower()
    if not media_type.startswith("image/"):
        raise ValueError(f"Image URL {show_url(url)!r}: data URL of media type {media_type or '(none)'!r}; "
                         "an image needs image/* (image/png, image/jpeg, ...).")
    if "base64" not in (p.strip().lower() for p in params):
        raise ValueError(f"Image URL {show_url(url)!r}: only base64 data URLs are supported "
                         "(data:image/png;base64,...).")
    payload = "".join(payload.split())  # line breaks some encoders insert
    if len(payload) // 4 * 3 > policy.max_image_bytes + 2:  # checked before decoding
        raise ValueError(f"Image URL {show_url(url)!r}: the image is larger than "
                         f"{policy.max_image_bytes} bytes (--max-image-bytes).")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"Image URL {show_url(url)!r}: the data is not valid base64.") from None
    if len(data) > policy.max_image_bytes:
        raise ValueError(f"Image URL {show_url(url)!r}: the image is {len(data)} bytes, more than "
                         f"{policy.max_image_bytes} (--max-image-bytes).")
    return data


def local_media_path(url: str, policy: MediaPolicy) -> str:
    """The resolved path of a file:// URL inside --allowed-local-media-path, else ValueError."""
    if policy.allowed_local_media_path is None:
        raise ValueError(f"Image URL {show_url(url)!r}: file:// URLs are refused; the server reads "
                         "local files only under --allowed-local-media-path.")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"Image URL {show_url(url)!r}: a file:// URL names a local path "
                         "(file:///path), not a host.")
    if parts.query or parts.fragment:
        raise ValueError(f"Image URL {show_url(url)!r}: a file:// URL takes no query or fragment.")
    raw = url2pathname(unquote(parts.path))
    if "\x00" in raw or not os.path.isabs(raw):
        raise ValueError(f"Image URL {show_url(url)!r}: not an absolute path.")
    root = policy.allowed_local_media_path
    path = os.path.realpath(raw)  # symlinks and .. resolved: the file that would be read
    if os.path.commonpath([root, path]) != root:
        raise ValueError(f"Image URL {show_url(url)!r}: the file is outside the allowed local media "
                         f"path {root!r} (--allowed-local-media-path).")
    return path


def _read_file_url(url: str, policy: MediaPolicy) -> bytes:
    path = local_media_path(url, policy)
    try:
        # O_NONBLOCK: a FIFO must not hold the worker; only regular files are read
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ValueError(f"Image URL {show_url(url)!r}: cannot open the file ({exc.strerror}).") from None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ValueError(f"Image URL {show_url(url)!r}: not a regular file.")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > policy.max_image_bytes:
            raise ValueError(f"Image URL {show_url(url)!r}: the file is {st.st_size} bytes, more than "
                             f"{policy.max_image_bytes} (--max-image-bytes).")
        data = f.read(policy.max_image_bytes + 1)
    if len(data) > policy.max_image_bytes:  # grew since fstat
        raise ValueError(f"Image URL {show_url(url)!r}: the file is more than "
                         f"{policy.max_image_bytes} bytes (--max-image-bytes).")
    return data


def decode_image(data: bytes, policy: MediaPolicy, source: str = "the image") -> Image.Image:
    """Decode `data` (one of SUPPORTED_IMAGE_FORMATS) to an RGB image; the size is checked
    against `policy.max_image_pixels` from the header, before decoding."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data), formats=SUPPORTED_IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:  # PIL's own cap (2 x Image.MAX_IMAGE_PIXELS),
        # checked from the header inside open(), above ours unless --max-image-pixels is raised
        found = re.search(r"\((\d+) pixels\)", str(exc))
        count = f"{found.group(1)} pixels" if found else "too many pixels"
        raise ValueError(f"{source}: {count}, more than the limit of {policy.max_image_pixels} "
                         f"(--max-image-pixels; PIL refuses more than {2 * Image.MAX_IMAGE_PIXELS} "
                         "in any case).") from None
    except Exception:
        raise ValueError(f"{source}: {_unreadable(data)}") from None
    width, height = img.size
    if width * height > policy.max_image_pixels:
        raise ValueError(f"{source}: {width}x{height} = {width * height} pixels, more than the "
                         f"limit of {policy.max_image_pixels} (--max-image-pixels).")
    if width < 1 or height < 1:
        raise ValueError(f"{source}: the image is empty ({width}x{height}).")
    try:
        img.load()
        return to_rgb(img)
    except Exception as exc:
        raise ValueError(f"{source}: the {img.format} image could not be decoded "
                         f"({type(exc).__name__}: {exc}).") from None


def _unreadable(data: bytes) -> str:
    """Why PIL could not open `data`: a format it knows but requests may not use, or none."""
    from PIL import Image

    supported = ", ".join(SUPPORTED_IMAGE_FORMATS)
    if not data:
        return "the image data is empty."
    try:  # identify only (the header); nothing of another format is decoded
        with Image.open(io.BytesIO(data)) as other:
            fmt = other.format
    except Exception:
        fmt = None
    if fmt and fmt not in SUPPORTED_IMAGE_FORMATS:
        return f"image format {fmt} is not supported; supported: {supported}."
    return f"the data could not be decoded as an image (supported formats: {supported})."


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB, upright: the EXIF orientation applied, transparency composited over white."""
    from PIL import Image, ImageOps

    img = ImageOps.exif_transpose(img) or img
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")

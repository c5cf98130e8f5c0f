"""Fetching an image over http(s) under the media policy (media.py), with httpx.

Only hosts in `--allowed-media-domains` are contacted (exact host names, as vLLM compares
them); redirects are followed by hand, each hop checked against the same list, so a redirect
cannot lead off it. The whole fetch (connection, redirects, body) has one deadline,
`--media-fetch-timeout`: each operation is given what is left of it, and a body dribbled in
small pieces is stopped between them. The body is streamed and dropped past
`--max-image-bytes` (a larger Content-Length is refused before reading). Blocking: callers
run it off the event loop.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import httpx

from pagedllm.multimodal.urls import show_url

if TYPE_CHECKING:
    from pagedllm.multimodal.media import MediaPolicy


def _host(url: httpx.URL | str) -> str:
    return (url.host if isinstance(url, httpx.URL) else httpx.URL(url).host).lower().rstrip(".")


def check_remote_url(url: str, policy: MediaPolicy, redirected_from: str | None = None) -> httpx.URL:
    """The parsed URL when its scheme is http(s) and its host is allowed, else ValueError."""
    via = f" (redirected from {show_url(redirected_from)!r})" if redirected_from else ""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise ValueError(f"Image URL {show_url(url)!r}{via} is not a valid URL ({exc}).") from None
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"Image URL {show_url(url)!r}{via}: only http(s) URLs are fetched.")
    if not policy.allowed_media_domains:
        raise ValueError(f"Image URL {show_url(url)!r}{via}: remote images are refused; the server "
                         "fetches only from hosts listed in --allowed-media-domains (none given).")
    allowed = {_host(f"http://{d}/") for d in policy.allowed_media_domains}
    if _host(parsed) not in allowed:
        raise ValueError(f"Image URL {show_url(url)!r}{via}: host {parsed.host!r} is not in "
                         "--allowed-media-domains.")
    return parsed


def fetch_bytes(url: str, policy: MediaPolicy) -> bytes:
    """The body of a GET of `url`, following allowed redirects; ValueError on any refusal,
    timeout, HTTP error status or oversize body."""
    current = check_remote_url(url, policy)
    deadline = time.monotonic() + policy.fetch_timeout_s
    timeout_msg = (f"Image URL {show_url(url)!r}: no complete answer within "
                   f"{policy.fetch_timeout_s:g} s (--media-fetch-timeout).")
    headers = {"Accept": "image/*", "Accept-Encoding": "identity"}
    try:
        with httpx.Client(follow_redirects=False, headers=headers) as client:
            for _ in range(policy.max_redirects + 1):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ValueError(timeout_msg)
                with client.stream("GET", current, timeout=httpx.Timeout(left)) as resp:
                    if resp.is_redirect:
                        location = resp.headers.get("location", "")
                        target = str(resp.url.join(location))
                        current = check_remote_url(target, policy, redirected_from=str(current))
                        continue
                    if resp.status_code != 200:
                        raise ValueError(f"Image URL {show_url(url)!r}: the server answered HTTP "
                                         f"{resp.status_code}.")
                    return _read_body(resp, url, policy, deadline, timeout_msg)
    except httpx.TimeoutException:
        raise ValueError(timeout_msg) from None
    except httpx.HTTPError as exc:
        raise ValueError(f"Image URL {show_url(url)!r}: could not fetch it "
                         f"({type(exc).__name__}: {exc}).") from None
    raise ValueError(f"Image URL {show_url(url)!r}: more than {policy.max_redirects} redirects.")


def _read_body(resp: httpx.Response, url: str, policy: MediaPolicy, deadline: float,
               timeout_msg: str) -> bytes:
    cap = policy.max_image_bytes
    too_big = (f"Image URL {show_url(url)!r}: the image is larger than {cap} bytes "
               "(--max-image-bytes).")
    length = resp.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > cap:
        raise ValueError(too_big)
    body = bytearray()
    for chunk in resp.iter_bytes():
        body += chunk
        if len(body) > cap:
            raise ValueError(too_big)
        if time.monotonic() > deadline:
            raise ValueError(timeout_msg)
    return bytes(body)

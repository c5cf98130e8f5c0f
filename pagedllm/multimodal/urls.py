"""How error messages quote an image URL (media.py, media_http.py, chat_parts.py)."""

from __future__ import annotations


def show_url(url: str, limit: int = 120) -> str:
    """A URL as error messages quote it: a data URL by its header only, a long one cut."""
    if url[:5].lower() == "data:":
        head = url.split(",", 1)[0]
        return f"{head[:limit]},... ({len(url)} characters)"
    return url if len(url) <= limit else url[:limit] + "..."

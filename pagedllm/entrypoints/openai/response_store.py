"""The in-memory store of finished responses (`store: true`, the Responses API's default):
`GET /v1/responses/{id}`, `DELETE`, and `previous_response_id` continuation read it.

Bounded twice: at most `max_entries` responses and `max_bytes` of their JSON (the response,
the input items a continuation replays and, for a background response, its stream's events,
which a client may stream again); the least recently used go first when either bound is
passed. Ids are `resp_` + 24 random bytes in hex (unguessable). With API keys, each
entry belongs to the key that made it (a SHA-256 of the key, not the key itself): another key
sees it as missing, the same 404 as an id that never existed, so ids do not leak.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


def new_response_id() -> str:
    return f"resp_{secrets.token_hex(24)}"


def owner_of(authorization: str | None, keyed: bool) -> str | None:
    """The owner of a request's responses: its API key's digest on a server with keys
    (the middleware has checked the key), else None (everyone shares one space)."""
    if not keyed or not authorization:
        return None
    return hashlib.sha256(authorization.encode()).hexdigest()


@dataclass
class StoredResponse:
    owner: str | None
    response: dict[str, Any]  # the response object as returned
    input_items: list[dict[str, Any]]  # the whole conversation's input (earlier turns included)
    size: int  # bytes of JSON, counted against max_bytes
    n_history: int = 0  # how many of input_items came from earlier turns (previous_response_id)
    events: list[str] | None = None  # a background response's stream events (SSE text)

    @property
    def own_input_items(self) -> list[dict[str, Any]]:
        """The items this request sent (GET /v1/responses/{id}/input_items lists them)."""
        return self.input_items[self.n_history:]


class ResponseStore:
    """An LRU map of response id -> StoredResponse within both bounds (thread-safe: the
    event loop writes it, nothing else does, but tests read it from other threads)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries < 1:
            raise ValueError(f"--responses-store-max-entries must be at least 1, got {max_entries}.")
        if max_bytes < 1:
            raise ValueError(f"--responses-store-max-bytes must be at least 1, got {max_bytes}.")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evicted = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: str | None, response: dict[str, Any],
            input_items: list[dict[str, Any]], n_history: int = 0,
            events: list[str] | None = None) -> bool:
        """Keep a response (a later put of the same id replaces it: a background response is
        kept queued, then finished); False when it alone is over max_bytes (not kept)."""
        size = len(json.dumps(response, separators=(",", ":"))) + len(
            json.dumps(input_items, separators=(",", ":"))) + sum(map(len, events or ()))
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(response["id"], None)
            if old is not None:
                self.bytes -= old.size
            self._entries[response["id"]] = StoredResponse(owner, response, input_items, size,
                                                           n_history, events)
            self.bytes += size
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                _, gone = self._entries.popitem(last=False)
                self.bytes -= gone.size
                self.evicted += 1
        return True

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """The entry, if it exists and belongs to `owner` (touched: most recently used)."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return None
            self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str, owner: str | None) -> bool:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return False
            del self._entries[response_id]
            self.bytes -= entry.size
            return True

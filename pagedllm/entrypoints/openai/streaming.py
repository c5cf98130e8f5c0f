"""Server-sent events and the text deltas of a stream.

A stream is `data: {json}\\n\\n` events ending with `data: [DONE]\\n\\n`. The engine's outputs
are cumulative; `ChoiceStream` turns them into deltas for one choice. While a choice runs, text
that may be the start of a stop string is held back (`num_held_back_chars`): if the stop string
completes, the client never sees any of it; if not, the text goes out with the next delta. So
the concatenated deltas always equal the final, non-streamed text.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TypeVar

from pydantic import BaseModel

from pagedllm.outputs import CompletionOutput, Logprob

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(chunk: BaseModel, include_usage: bool = False) -> str:
    """One event. `usage` is sent (null until the last chunk) only when the client asked for
    it with stream_options.include_usage; a chat delta carries only the fields it has."""
    data = chunk.model_dump()
    if not include_usage:
        data.pop("usage", None)
    for choice in data.get("choices", ()):
        delta = choice.get("delta")
        if delta is not None:
            choice["delta"] = {k: v for k, v in delta.items() if v is not None}
    payload = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


class ChoiceStream:
    """What one choice of a stream has sent: characters (completions' text offsets), tokens
    (usage) and whether it finished. The engine's outputs are DELTAs (`RequestOutputKind`):
    text that may become a stop string is held back there, so each delta goes out as it is."""

    def __init__(self) -> None:
        self.sent_chars = 0
        self.sent_tokens = 0
        self.finished = False

    def delta(
        self, out: CompletionOutput
    ) -> tuple[str, list[int], list[dict[int, Logprob]] | None]:
        """(new text, new token ids, their logprobs) of this delta, counted as sent."""
        self.sent_chars += len(out.text)
        self.sent_tokens += len(out.token_ids)
        if out.finish_reason is not None:
            self.finished = True
        return out.text, out.token_ids, out.logprobs


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Yield (index of the iterator, item) as items arrive from any of the iterators. Closing
    this generator cancels and closes all of them (which aborts their engine requests)."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending: dict[asyncio.Future, int] = {
        asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iterators[i].__anext__())] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    pass

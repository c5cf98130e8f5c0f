"""Background responses (`background: true`): the generation runs as a task of the server's
event loop, not of the HTTP request, so the client may leave, poll
`GET /v1/responses/{id}`, stream it (`?stream=true&starting_after=N`, from any event on) or
cancel it (`POST /v1/responses/{id}/cancel`).

A run keeps every event it emitted; followers (the creating request when it streams, any
later streaming GET) read that list and wait for more, so each sees the same
`sequence_number`s. The finished response is kept in the store with its events (counted in
the store's byte bound), and a stream of it can still be replayed there. Cancelling stops the
task: the engine request is aborted (its KV blocks return) and the response is kept as
`cancelled` with the output made so far.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedllm.engine.request_stream import RequestStream
from pagedllm.entrypoints.openai.responses_turn import Turn
from pagedllm.entrypoints.openai.tool_calling import ToolPlan


class BackgroundRun:
    """One background response's task and its events; `on_done` runs when it ends (the server
    forgets the run: the store has it from then on)."""

    def __init__(self, turn: Turn, stream: RequestStream, plan: ToolPlan,
                 on_done: Callable[[BackgroundRun], None]) -> None:
        self.turn = turn
        self.stream = stream
        self.events: list[str] = []
        self.done = False
        self._changed = asyncio.Event()
        self._on_done = on_done
        self.task = asyncio.get_running_loop().create_task(self._run(plan),
                                                           name=f"background {turn.id}")

    def _publish(self, text: str | None = None) -> None:
        if text is not None:
            self.events.append(text)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _run(self, plan: ToolPlan) -> None:
        try:
            async for text in self.turn.stream(None, self.stream, plan):
                self._publish(text)
        except asyncio.CancelledError:  # cancel(): the stream's finally aborted the request
            self.turn.final = self.turn.obj("cancelled", self.turn.builder.items)
        finally:
            self._finish()

    def _finish(self) -> None:
        """Keep the final response with the events, wake the followers, forget the run (once;
        also for a task cancelled before it ever ran, whose body never started)."""
        if self.done:
            return
        self.done = True
        turn = self.turn
        turn.server.ctx.async_engine.abort_unfinished([self.stream])
        turn.keep(turn.final or turn.obj("cancelled", turn.builder.items), self.events)
        self._publish()
        self._on_done(self)

    async def follow(self, starting_after: int = -1) -> AsyncIterator[str]:
        """The events after sequence number `starting_after`, then each new one as it comes,
        until the run ends. Leaving (a client gone) does not stop the run."""
        i = starting_after + 1
        while True:
            changed = self._changed
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            await changed.wait()

    async def cancel(self) -> dict[str, Any]:
        """Stop the run; the cancelled response (as kept)."""
        if not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self._finish()
        assert self.turn.final is not None
        return self.turn.final


async def replay(events: list[str], starting_after: int) -> AsyncIterator[str]:
    """A finished background response's events after `starting_after`."""
    for text in events[starting_after + 1:]:
        yield text

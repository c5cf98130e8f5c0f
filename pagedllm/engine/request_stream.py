"""One request's outputs on the server's event loop (engine/async_engine.py fills it)."""

from __future__ import annotations

import asyncio

from pagedllm.outputs import RequestOutput
from pagedllm.pooling.outputs import PoolingRequestOutput


class RequestStream:
    """The outputs of one request, on the event loop: what was not read yet, or an error.
    An unread CUMULATIVE output is superseded by the next, an unread DELTA one absorbs it
    (`RequestOutput.add`). Only the event loop thread touches it."""

    def __init__(self, request_id: str, serial: int = -1, delta: bool = False) -> None:
        self.request_id = request_id
        self.serial = serial  # unique per add: tells apart requests that reuse an id
        self.core_id = f"{serial}:{request_id}"
        self.engine_index = 0
        self.finished = False
        self.delta = delta
        self._latest: RequestOutput | PoolingRequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def put(self, output: RequestOutput | PoolingRequestOutput) -> None:
        if self.delta and self._latest is not None:
            self._latest.add(output)
        else:
            self._latest = output
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    async def get(self) -> RequestOutput | PoolingRequestOutput:
        """The next (newest) output; raises the request's error if it failed."""
        while True:
            if self._latest is None and self._error is None:
                self._event.clear()
                await self._event.wait()
            if self._latest is not None:
                out, self._latest = self._latest, None
                if out.finished:
                    self.finished = True
                return out
            if self._error is not None:
                self.finished = True
                raise self._error

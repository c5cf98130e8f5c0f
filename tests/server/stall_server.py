"""`pagedllm serve` whose engine stalls on purpose, for tests/server/test_scheduler_stall.py.

    python -m tests.server.stall_server [serve flags]

`LLMEngine.step` is wrapped: once a request whose prompt contains `STALL_MARKER` holds KV
blocks (two tokens generated), the next step raises `SchedulerStallError` naming it, as the
engine's watchdog does when the scheduler makes no progress. Other requests run normally.
"""

from __future__ import annotations

import sys

from pagedllm.engine.engine import LLMEngine
from pagedllm.engine.errors import SchedulerStallError

STALL_MARKER = "STALL-ME"

_step = LLMEngine.step


def _stalling_step(self):
    stuck = [
        rid for rid, state in self.requests.items()
        if STALL_MARKER in (state.prompt or "")
        and any(len(s.output_token_ids) >= 2 for s in state.seqs)
    ]
    if stuck:
        raise SchedulerStallError(stuck, num_steps=100)
    return _step(self)


LLMEngine.step = _stalling_step

if __name__ == "__main__":
    from pagedllm.entrypoints.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))

"""`pagedllm serve` whose engine core stalls on purpose, for tests/server/test_scheduler_stall.py.

    python -m tests.server.stall_server [serve flags]

`EngineCore.step` is wrapped: once a request whose prompt contains the token ids of
`STALL_MARKER` holds KV blocks (two tokens generated), the next step raises
`SchedulerStallError` naming it, as the core's watchdog does when the scheduler makes no
progress. Other requests run normally. The patch is made when this module is the program: as
`__main__` in the server, as `__mp_main__` in the engine core process (spawned, which imports the
parent's main module under that name). Imported by a test (for `STALL_MARKER`) it patches
nothing: a patched `EngineCore.step` in the pytest process would stall other tests' engines
(a tokenizer without the marker's words gives no marker ids, which every prompt "contains").
"""

from __future__ import annotations

import sys

from pagedllm.engine.core import EngineCore
from pagedllm.engine.errors import SchedulerStallError

STALL_MARKER = "STALL-ME"

_step = EngineCore.step
_marker_ids: list[int] | None = None


def _contains(ids: list[int], sub: list[int]) -> bool:
    n = len(sub)
    return any(ids[i:i + n] == sub for i in range(len(ids) - n + 1))


def _stalling_step(self):
    global _marker_ids
    if _marker_ids is None:
        from pagedllm.tokenizer import load_tokenizer

        tok = load_tokenizer(self.source.path, self.source.gguf_file)
        # The marker's ids in running text (after a space), as a prompt holds it.
        _marker_ids = tok.encode(" " + STALL_MARKER, add_special_tokens=False)[1:]
    stuck = [
        rid for rid, state in self.requests.items()
        if _contains(state.prompt_token_ids, _marker_ids)
        and any(len(s.output_token_ids) >= 2 for s in state.seqs)
    ]
    if stuck:
        raise SchedulerStallError(stuck, num_steps=100)
    return _step(self)


if __name__ in ("__main__", "__mp_main__"):
    EngineCore.step = _stalling_step

if __name__ == "__main__":
    from pagedllm.entrypoints.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))

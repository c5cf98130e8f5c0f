"""Errors the engine raises about itself (not about a request's input, which is a ValueError)."""

from __future__ import annotations

# Consecutive steps with unfinished requests that schedule nothing and move no block before
# the watchdog calls it a stall (the scheduler's liveness argument allows one or two such
# steps in a row, never many).
STALL_STEPS = 100


class SchedulerStallError(RuntimeError):
    """The engine has unfinished requests but made no progress for many consecutive steps.

    That is a bug in the scheduler, never the caller's fault: the offline API raises it, the
    server fails the named requests with a 500 and reports itself unhealthy.
    """

    def __init__(self, request_ids: list[str], num_steps: int, detail: str = "") -> None:
        self.request_ids = list(request_ids)
        self.num_steps = num_steps
        shown = ", ".join(self.request_ids[:20]) + (" ..." if len(self.request_ids) > 20 else "")
        message = (
            f"The scheduler made no progress for {num_steps} consecutive steps with "
            f"{len(self.request_ids)} unfinished request(s): {shown}"
        )
        super().__init__(message + (f" ({detail})" if detail else ""))


class EngineFatalError(RuntimeError):
    """The engine core cannot go on: its shared state (scheduler, KV blocks, workers, device)
    is unknown after a failure. The core reports it and exits non-zero; the server answers 503
    and exits so that its supervisor restarts it (docs/processes.md, "Which errors are fatal")."""


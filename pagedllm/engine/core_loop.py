"""The engine core's busy loop: apply what the front end sent, step, send the step's outputs.

It owns an `EngineCore` and is the only code that calls it. Messages come in through a
thread-safe queue (`put`), filled by whoever listens to the front end (a ZeroMQ thread in the
core process, or the event loop of an in-process server); each step's `EngineCoreOutputs` go
out through `send`. It never waits for the front end while it has work: it blocks on the queue
only when no request is unfinished.

Which failures are fatal is decided here, in one place (docs/processes.md has the table):

- a message that fails, one at a time: an add the core refuses (`ValueError`) is an error
  output for that request (kind "invalid": the client's 400); an add that fails otherwise
  before the request was committed is that request's 500 ("internal"); a message the input
  thread could not decode is answered for its request id when one can be read (`reject`);
- a scheduler stall (the watchdog) fails and drops the named requests, flags the core
  unhealthy (`health_error`), and the loop goes on;
- anything else raised by a step, an abort, or the commit of an add (worker or executor
  failure, device error, out of memory, a bug) leaves the shared state unknown: every request
  in flight fails with kind "fatal" (a 503), the outputs carry `fatal_error`, and `run` raises
  `EngineFatalError`, so the core process exits non-zero and the server follows.
"""

from __future__ import annotations

import json
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from pagedllm.engine.core_messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
)
from pagedllm.engine.errors import EngineFatalError, SchedulerStallError

logger = logging.getLogger(__name__)


class CoreBusyLoop:
    def __init__(self, core: Any, send: Callable[[EngineCoreOutputs], None],
                 engine_index: int = 0) -> None:
        self.core = core
        self.send = send
        self.engine_index = engine_index
        self.inputs: queue.SimpleQueue[tuple[EngineCoreRequestType, Any]] = queue.SimpleQueue()
        self._stopped = False
        self._last_stats = None
        # requests whose grammar is compiling: request id -> (request, future of the grammar)
        self._compiling: dict[str, tuple[EngineCoreRequest, Any]] = {}

    def put(self, kind: EngineCoreRequestType, payload: Any) -> None:
        self.inputs.put((kind, payload))

    def reject(self, request_id: str, message: str) -> None:
        """Answer a request whose message could not be read (from the input thread)."""
        self.inputs.put((_REJECT, (request_id, message)))

    def run(self) -> None:
        """Until a SHUTDOWN message."""
        core = self.core
        while not self._stopped:
            if self._compiling:
                self._add_compiled()
            if not core.has_unfinished_requests():
                self._handle(*self.inputs.get())  # idle: wait for the front end
            while not self._stopped:
                try:
                    item = self.inputs.get_nowait()
                except queue.Empty:
                    break
                self._handle(*item)
            if self._stopped:
                return
            if core.has_unfinished_requests():
                self._step()
            else:
                self._send_stats()  # the gauges after aborts

    # ---- messages -------------------------------------------------------------------------

    def _handle(self, kind: EngineCoreRequestType | str, payload: Any) -> None:
        """One message; a failure that is not fatal stays inside it."""
        try:
            self._apply(kind, payload)
        except EngineFatalError:
            raise
        except Exception as exc:
            logger.exception("The engine core could not apply a %s message", _kind_name(kind))
            self._fatal(f"applying a {_kind_name(kind)} message failed: {exc!r}")

    def _apply(self, kind: EngineCoreRequestType | str, payload: Any) -> None:
        core = self.core
        if kind == _REJECT:
            request_id, message = payload
            self._send_errors([(request_id, message, "invalid")])
        elif kind == _COMPILED:
            pass  # a wake-up: `_add_compiled` runs each turn of the loop
        elif kind == _ADD_COMPILED:
            request, fut = payload
            self._add(request, lambda: core.add_request(request, fut.result()))
        elif kind == EngineCoreRequestType.ADD:
            self._add(payload, lambda: self._start_add(payload))
        elif kind == EngineCoreRequestType.ABORT:
            for rid in payload:
                self._compiling.pop(rid, None)
            core.abort_requests(payload)
        elif kind == EngineCoreRequestType.FINISH_SAMPLES:
            core.finish_samples([(rid, int(index)) for rid, index in payload])
        elif kind == EngineCoreRequestType.UTILITY:
            call_id, name, args = payload
            try:
                result, ok = json.dumps(_plain(core.utility(name, list(args)))), True
            except Exception as exc:
                result, ok = str(exc), False
            self.send(EngineCoreOutputs(utility_result=(call_id, result, ok),
                                        engine_index=self.engine_index, timestamp=time.time()))
        elif kind == EngineCoreRequestType.SHUTDOWN:
            self._stopped = True
            shutdown = getattr(core, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()  # the workers first, while their links are open
                except Exception:
                    logger.exception("The engine core's shutdown failed")
        else:
            logger.error("Unknown message kind %r from the front end", kind)

    def _add(self, request: EngineCoreRequest, add: Callable[[], None]) -> None:
        """Run an add; its failure before the commit is that request's error output: 400 for
        a ValueError, else 500 (nothing of it is held). A fatal error goes on up."""
        try:
            add()
        except ValueError as exc:
            self._send_errors([(request.request_id, str(exc), "invalid")])
        except EngineFatalError:
            raise
        except Exception as exc:
            logger.exception("add_request(%s) failed", request.request_id)
            self._send_errors([(request.request_id, f"The engine could not add the "
                                f"request: {exc!r}", "internal")])

    def _start_add(self, request: EngineCoreRequest) -> None:
        """Add now, or park the request while its grammar compiles in another process (it is
        added when done; meanwhile the others step)."""
        core = self.core
        pending = core.start_compile(request) if hasattr(core, "start_compile") else None
        if pending is None:
            core.add_request(request)
        elif pending.done():
            core.add_request(request, pending.result())
        else:
            self._compiling[request.request_id] = (request, pending)
            pending.add_done_callback(lambda _: self.inputs.put((_COMPILED, None)))

    def _add_compiled(self) -> None:
        """Add the requests whose grammar finished compiling (or fail them: a 400)."""
        for rid, (request, fut) in list(self._compiling.items()):
            if not fut.done():
                continue
            del self._compiling[rid]
            self._handle(_ADD_COMPILED, (request, fut))

    # ---- the step -------------------------------------------------------------------------

    def _step(self) -> None:
        core = self.core
        t0 = time.perf_counter()
        try:
            outputs = core.step()
        except SchedulerStallError as exc:
            # The watchdog: these requests make no progress. Fail and drop them (their blocks
            # return), report the core unhealthy until restart, serve the others.
            logger.error("Scheduler stall: %s; aborting those requests, /health now 503", exc)
            message = str(SchedulerStallError(
                [], exc.num_steps,
                "the request was aborted; the server reports itself unhealthy until restarted"))
            core.abort_requests(exc.request_ids)
            self._send_errors([(rid, message, "stall") for rid in exc.request_ids],
                              health_error=str(exc))
            return
        except Exception as exc:
            # Workers, device, memory or a bug: what the step changed is unknown.
            logger.exception("The engine step failed; the engine core stops")
            self._fatal(f"the engine step failed: {exc!r}")
        outputs.stats = self._stats_if_changed()
        if outputs.outputs or outputs.stats is not None:
            self.send(outputs)
        if not outputs.outputs and time.perf_counter() - t0 < 1e-3:
            time.sleep(1e-3)  # nothing could be scheduled: do not spin

    def _fatal(self, why: str) -> None:
        """Fail every request in flight (503), tell the front end, and stop the loop."""
        message = (f"The engine core {self.engine_index} stopped after a fatal error ({why}); "
                   "the server must be restarted.")
        try:
            rids = list(self.core.requests)
        except Exception:
            rids = []
        rids += list(self._compiling)
        self._send_errors([(rid, message, "fatal") for rid in rids], fatal_error=message,
                          with_stats=False)
        self._stopped = True
        raise EngineFatalError(message)

    def _send_errors(self, failures: list[tuple[str, str, str]],
                     health_error: str | None = None, fatal_error: str | None = None,
                     with_stats: bool = True) -> None:
        self.send(EngineCoreOutputs(
            [EngineCoreOutput(rid, [], finished=True, error=msg, error_kind=kind)
             for rid, msg, kind in failures],
            stats=self._stats_if_changed() if with_stats else None, timestamp=time.time(),
            engine_index=self.engine_index, health_error=health_error, fatal_error=fatal_error,
        ))

    def _stats_if_changed(self):
        stats = self.core.stats()
        if stats == self._last_stats:
            return None
        self._last_stats = stats
        return stats

    def _send_stats(self) -> None:
        stats = self._stats_if_changed()
        if stats is not None:
            self.send(EngineCoreOutputs(stats=stats, timestamp=time.time(),
                                        engine_index=self.engine_index))


# internal message kinds
_REJECT = "reject"  # (request id, why its message was unreadable)
_COMPILED = "compiled"  # a grammar finished compiling: wake the loop up
_ADD_COMPILED = "add-compiled"  # (request, its grammar's future)


def _kind_name(kind: EngineCoreRequestType | str) -> str:
    return kind.name if isinstance(kind, EngineCoreRequestType) else str(kind)


def _plain(value: Any) -> Any:
    """A utility call's result as JSON-able data (dataclasses become dicts)."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value

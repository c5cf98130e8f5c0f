"""The engine core's busy loop: apply what the front end sent, step, send the step's outputs.

It owns an `EngineCore` and is the only code that calls it. Messages come in through a
thread-safe queue (`put`), filled by whoever listens to the front end (a ZeroMQ thread in the
core process, or the event loop of an in-process server); each step's `EngineCoreOutputs` go
out through `send`. It never waits for the front end while it has work: it blocks on the queue
only when no request is unfinished.

Failures stay inside the request they belong to: a rejected add is an error output for that
request (kind "invalid": the client's 400); a scheduler stall (the watchdog) fails and drops
the named requests and flags the core unhealthy (`health_error`), and the loop goes on; any
other exception in a step fails the requests in flight (kind "internal") and the loop goes on
with the next ones.
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
from pagedllm.engine.errors import SchedulerStallError

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

    def put(self, kind: EngineCoreRequestType, payload: Any) -> None:
        self.inputs.put((kind, payload))

    def run(self) -> None:
        """Until a SHUTDOWN message."""
        core = self.core
        while not self._stopped:
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

    def _handle(self, kind: EngineCoreRequestType, payload: Any) -> None:
        core = self.core
        if kind == EngineCoreRequestType.ADD:
            request: EngineCoreRequest = payload
            try:
                core.add_request(request)
            except ValueError as exc:
                self._send_errors([(request.request_id, str(exc), "invalid")])
            except Exception as exc:
                logger.exception("add_request(%s) failed", request.request_id)
                self._send_errors([(request.request_id, f"The engine could not add the "
                                    f"request: {exc!r}", "internal")])
        elif kind == EngineCoreRequestType.ABORT:
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
            # A bug, not a request's fault: fail the requests that were in flight, drop them
            # so that their blocks return, and go on serving the next ones.
            logger.exception("The engine step failed; aborting the requests in flight")
            rids = list(core.requests)
            core.abort_requests(rids)
            self._send_errors([(rid, f"The engine failed while running this request: {exc}",
                                "internal") for rid in rids])
            return
        outputs.stats = self._stats_if_changed()
        if outputs.outputs or outputs.stats is not None:
            self.send(outputs)
        if not outputs.outputs and time.perf_counter() - t0 < 1e-3:
            time.sleep(1e-3)  # nothing could be scheduled: do not spin

    def _send_errors(self, failures: list[tuple[str, str, str]],
                     health_error: str | None = None) -> None:
        self.send(EngineCoreOutputs(
            [EngineCoreOutput(rid, [], finished=True, error=msg, error_kind=kind)
             for rid, msg, kind in failures],
            stats=self._stats_if_changed(), timestamp=time.time(),
            engine_index=self.engine_index, health_error=health_error,
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


def _plain(value: Any) -> Any:
    """A utility call's result as JSON-able data (dataclasses become dicts)."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value

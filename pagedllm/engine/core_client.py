"""The front end's handle on one engine core: in a thread of this process, or in its own.

Both clients have one surface for `AsyncLLMEngine`: `start(loop, on_outputs, on_death)`, then
`add_request` / `abort_requests` / `finish_samples` / `call_utility` (fire and forget, from the
event loop thread), each step's `EngineCoreOutputs` delivered to `on_outputs` on the event
loop, and `shutdown()`.

- `MPCoreClient` (the server's default): spawns `core_process.run_engine_core`, talks ZeroMQ
  (ipc sockets in a private temporary folder), reads outputs in a thread that decodes them and
  hands them to the loop, and watches the process: its end (killed, crashed, out of memory)
  reaches `on_death` within milliseconds (a wait on the process sentinel).
- `InprocCoreClient`: the same `CoreBusyLoop` in a thread of this process (no IPC), for
  `PAGEDLLM_ENGINE_IN_PROCESS=1` and the tests.
- `RayCoreClient` (`--distributed-executor-backend ray` with `--data-parallel-size M`;
  engine/core_client_ray.py): the core process is a Ray actor on any node of the cluster.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from pagedllm.engine.core_channel import ChannelGuard
from pagedllm.engine.core_loop import CoreBusyLoop
from pagedllm.engine.core_messages import (
    CoreReady,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    decode_outputs,
    decode_ready,
    encode,
    ready_info,
)
from pagedllm.engine.core_process import CoreAddresses, run_engine_core

logger = logging.getLogger(__name__)

OnOutputs = Callable[[EngineCoreOutputs], None]
OnDeath = Callable[[int, str], None]


SOCKET_DIR_PREFIX = "pagedllm-core-"
# After the core's process ended: what it sent before is already in our socket's buffers (or
# the kernel's); the reader takes it until none came for DRAIN_QUIET_MS, for at most
# DRAIN_TIMEOUT_S, and only then is the death reported.
DRAIN_QUIET_MS = 200
DRAIN_TIMEOUT_S = 2.0


def sweep_stale_socket_dirs() -> list[str]:
    """Remove the socket folders of servers that are gone (a SIGKILLed server cannot remove
    its own): `pagedllm-core-<pid>-*` of this user whose pid no longer runs."""
    removed = []
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        if not name.startswith(SOCKET_DIR_PREFIX):
            continue
        pid_text = name[len(SOCKET_DIR_PREFIX):].split("-", 1)[0]
        path = os.path.join(base, name)
        try:
            if not pid_text.isdigit() or os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except OSError:
            continue
    return removed


class EngineCoreStartError(RuntimeError):
    """The engine core failed while loading (its message or traceback is attached)."""


class _LoopDelivery:
    """Hands objects from a thread to the event loop, until closed (then drops them)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    def call(self, fn: Callable, *args: Any) -> None:
        if self.closed or self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self._run, fn, args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _run(self, fn: Callable, args: tuple) -> None:
        if not self.closed:
            fn(*args)


class InprocCoreClient:
    """An engine core driven by a `CoreBusyLoop` in a thread of this process."""

    def __init__(self, core: Any, engine_index: int = 0, ready: CoreReady | None = None) -> None:
        self.core = core
        self.engine_index = engine_index
        self.ready = ready if ready is not None else ready_info(core)
        self._delivery = _LoopDelivery()
        self._busy: CoreBusyLoop | None = None
        self._thread: threading.Thread | None = None
        self.alive = False
        self.ended_how: str | None = None  # why the engine thread died, once it has

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OnOutputs,
              on_death: OnDeath) -> None:
        self._delivery.loop = loop
        self._busy = CoreBusyLoop(self.core, lambda o: self._delivery.call(on_outputs, o),
                                  self.engine_index)

        def main() -> None:
            try:
                self._busy.run()
            except BaseException as exc:
                logger.exception("The engine thread died")
                self.ended_how = repr(exc)
                self.alive = False
                self._delivery.call(on_death, self.engine_index, repr(exc))
            finally:
                self.alive = False

        self.alive = True
        self._thread = threading.Thread(target=main, name=f"pagedllm-engine-{self.engine_index}",
                                        daemon=True)
        self._thread.start()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._busy.put(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._busy.put(EngineCoreRequestType.ABORT, list(request_ids))

    def finish_samples(self, samples: list[tuple[str, int]]) -> None:
        self._busy.put(EngineCoreRequestType.FINISH_SAMPLES, list(samples))

    def call_utility(self, call_id: int, name: str, args: list) -> None:
        self._busy.put(EngineCoreRequestType.UTILITY, (call_id, name, args))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop after the current step; from now on nothing reaches the event loop."""
        self._delivery.closed = True
        if self._busy is not None:
            self._busy.put(EngineCoreRequestType.SHUTDOWN, None)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("The engine thread is still in a step after %.1f s; it stops "
                               "after that step and delivers nothing more.", timeout)
        self.alive = False


class MPCoreClient:
    """An engine core in a child process, over ZeroMQ."""

    def __init__(self, config: Any, engine_index: int = 0, startup_timeout: float = 1800.0,
                 socket_dir: str | None = None) -> None:
        self.engine_index = engine_index
        self._own_dir = socket_dir is None
        if socket_dir is None:
            sweep_stale_socket_dirs()
        self._dir = socket_dir or tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
        base = f"ipc://{self._dir}/core{engine_index}"
        ready_sock = self._bind_sockets(f"{base}-input", f"{base}-output", f"{base}-ready")
        # spawn: a fresh interpreter, no threads or CUDA state inherited. Not a daemon: the core
        # starts tensor-parallel workers of its own; it leaves with us (it watches its parent).
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(
            target=run_engine_core,
            args=(config, engine_index, self.addresses, os.getpid(),
                  logging.getLogger().getEffectiveLevel()),
            name=f"pagedllm-core-{engine_index}", daemon=False,
        )
        self._start(ready_sock, self.process.start, startup_timeout)

    def _bind_sockets(self, input_addr: str, output_addr: str, ready_addr: str) -> zmq.Socket:
        """Bind input (PUSH), output (PULL) and the hand-shake (PULL); a `tcp://host:0` address
        gets a free port, and `self.addresses` holds what the core must connect to."""
        self._ctx = zmq.Context()
        self._guard = ChannelGuard(self._ctx)  # CURVE: only this launch's core connects
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 1000)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        ready_sock = self._ctx.socket(zmq.PULL)
        bound = []
        for sock, addr in ((self._input, input_addr), (self._output, output_addr),
                           (ready_sock, ready_addr)):
            self._guard.secure(sock)
            sock.bind(addr)
            bound.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        self.addresses = CoreAddresses(*bound, keys=self._guard.core_keys)
        self._delivery = _LoopDelivery()
        self._stopping = False
        self._reader: threading.Thread | None = None
        self._reader_failed: str | None = None
        self._core_ended = threading.Event()  # set by the watcher: the reader drains, then stops
        self._closed = False
        self.alive = False
        self.ended_how: str | None = None  # why the core died, once it has
        return ready_sock

    def _start(self, ready_sock: zmq.Socket, launch: Callable[[], None], timeout: float) -> None:
        try:
            launch()
            self.ready = self._wait_ready(ready_sock, timeout)
        except BaseException:
            ready_sock.close(0)
            self._kill()
            self._close_sockets()
            raise
        ready_sock.close(0)
        self.alive = True

    def _process_exitcode(self) -> int | None:
        """None while the core runs; its exit code once it ended."""
        return None if self.process.is_alive() else self.process.exitcode

    def _wait_ready(self, sock: zmq.Socket, timeout: float) -> CoreReady:
        deadline = time.monotonic() + timeout
        while True:
            if sock.poll(200):
                ready = decode_ready(sock.recv())
                if ready.ok:
                    return ready
                self._join(10)
                if ready.error_is_value_error:
                    raise ValueError(ready.error)
                raise EngineCoreStartError(f"The engine core failed to start:\n{ready.error}")
            code = self._process_exitcode()
            if code is not None:
                how = f"exit code {code}" if isinstance(code, int) else code
                raise EngineCoreStartError(
                    f"The engine core process exited during start-up ({how}); see its "
                    "output above.")
            if time.monotonic() > deadline:
                raise EngineCoreStartError(f"The engine core did not start within {timeout:.0f} s.")

    # ---- running (event loop thread) ------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OnOutputs,
              on_death: OnDeath) -> None:
        self._delivery.loop = loop
        self._reader = threading.Thread(target=self._read_outputs, args=(on_outputs,),
                                        daemon=True, name=f"pagedllm-core{self.engine_index}-reader")
        self._reader.start()
        threading.Thread(target=self._watch_process, args=(on_death,), daemon=True,
                         name=f"pagedllm-core{self.engine_index}-watch").start()

    def _read_outputs(self, on_outputs: OnOutputs) -> None:
        """Each frame on its own: one that does not decode is dropped and logged. If the
        thread fails anyway, the core is stopped and reported dead (503, then the server
        exits): never a live core whose outputs nobody reads."""
        sock = self._output
        try:
            while not self._stopping:
                try:
                    if not sock.poll(DRAIN_QUIET_MS if self._core_ended.is_set() else 100):
                        if self._core_ended.is_set():
                            return  # the core is gone and what it sent has been read
                        continue
                    data = sock.recv(copy=False)
                except zmq.ZMQError:
                    return  # closed at shutdown
                try:
                    outputs = decode_outputs(data.buffer)
                except Exception as exc:
                    logger.error("Engine core %d: dropped an output frame that does not decode "
                                 "(%d bytes): %s", self.engine_index, len(data.buffer), exc)
                    continue
                self._delivery.call(on_outputs, outputs)
        except BaseException as exc:
            if self._stopping:
                return
            logger.exception("Engine core %d: the output reader failed; stopping the core",
                             self.engine_index)
            self._reader_failed = f"its output reader failed: {exc!r}"
            self._kill()  # the process watcher then reports the death

    def _watch_process(self, on_death: OnDeath) -> None:
        multiprocessing.connection.wait([self.process.sentinel])
        self.process.join(1)  # reaps it: exitcode is set
        code = self.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        self._report_end(on_death, f"Engine core {self.engine_index} (pid {self.process.pid})",
                         how)

    def _report_end(self, on_death: OnDeath, who: str, how: str) -> None:
        """The core's last outputs first, then its death: a core that stops after a fatal
        error sends that error (each request's 503 names it) and exits, and its exit must not
        overtake the message. The reader drains the socket until it is quiet, then stops; the
        loop runs what both scheduled in order."""
        if self._reader_failed:
            how = f"{self._reader_failed}; {how}"
        if not self._stopping:
            self.ended_how = how  # /health names the death while the reader drains
        self.alive = False
        self._core_ended.set()
        if self._reader is not None:
            self._reader.join(DRAIN_TIMEOUT_S)
        if self._stopping:
            return
        logger.error("%s died: %s", who, how)
        self._delivery.call(on_death, self.engine_index, how)

    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        if self._stopping:
            return
        self._input.send_multipart((bytes((int(kind),)), encode(payload)), copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def finish_samples(self, samples: list[tuple[str, int]]) -> None:
        self._send(EngineCoreRequestType.FINISH_SAMPLES, list(samples))

    def call_utility(self, call_id: int, name: str, args: list) -> None:
        self._send(EngineCoreRequestType.UTILITY, (call_id, name, args))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the core to stop; kill it if it has not within `timeout` seconds. Idempotent."""
        if self._closed:
            return
        if not self._stopping and self._process_exitcode() is None:
            try:
                self._send(EngineCoreRequestType.SHUTDOWN, None)
            except zmq.ZMQError:
                pass
        self._stopping = True
        self._delivery.closed = True
        self._join(timeout)
        self._kill()
        self._close_sockets()
        self.alive = False

    def _join(self, timeout: float) -> None:
        self.process.join(timeout)

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def _close_sockets(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        if self._reader is not None:
            self._reader.join(2)  # it polls every 0.1 s; a socket is closed by one thread
        for sock in (self._input, self._output):
            sock.close(0)
        self._guard.stop()
        self._ctx.term()
        if self._own_dir:
            shutil.rmtree(self._dir, ignore_errors=True)

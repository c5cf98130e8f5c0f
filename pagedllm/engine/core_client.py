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

from pagedllm.engine.core_loop import CoreBusyLoop
from pagedllm.engine.core_messages import (
    CoreReady,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    decode_outputs,
    decode_ready,
    encode,
)
from pagedllm.engine.core_process import CoreAddresses, run_engine_core

logger = logging.getLogger(__name__)

OnOutputs = Callable[[EngineCoreOutputs], None]
OnDeath = Callable[[int, str], None]


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


def ready_info(core: Any) -> CoreReady:
    """The hand-shake numbers of an in-process core (what a core process sends)."""
    return CoreReady(
        ok=True, num_blocks=getattr(core, "num_blocks", 0),
        block_size=getattr(core, "block_size", 16),
        max_model_len=getattr(core, "max_model_len", 0),
        max_num_batched_tokens=getattr(core, "max_num_batched_tokens", 0),
        model_name=getattr(core, "model_name", ""), vocab_size=getattr(core, "vocab_size", 0),
        eos_token_ids=sorted(getattr(core, "eos_token_ids", ())),
        startup_seconds=getattr(core, "startup_seconds", 0.0), pid=os.getpid(),
    )


class MPCoreClient:
    """An engine core in a child process, over ZeroMQ."""

    def __init__(self, config: Any, engine_index: int = 0, startup_timeout: float = 1800.0,
                 socket_dir: str | None = None) -> None:
        self.engine_index = engine_index
        self._own_dir = socket_dir is None
        self._dir = socket_dir or tempfile.mkdtemp(prefix="pagedllm-core-")
        base = f"ipc://{self._dir}/core{engine_index}"
        self.addresses = CoreAddresses(f"{base}-input", f"{base}-output", f"{base}-ready")
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 1000)
        self._input.bind(self.addresses.input)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(self.addresses.output)
        ready_sock = self._ctx.socket(zmq.PULL)
        ready_sock.bind(self.addresses.ready)
        self._delivery = _LoopDelivery()
        self._stopping = False
        self._reader: threading.Thread | None = None
        self._closed = False
        self.alive = False
        # spawn: a fresh interpreter, no threads or CUDA state inherited. Not a daemon: the core
        # starts tensor-parallel workers of its own; it leaves with us (it watches its parent).
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(
            target=run_engine_core,
            args=(config, engine_index, self.addresses, os.getpid(),
                  logging.getLogger().getEffectiveLevel()),
            name=f"pagedllm-core-{engine_index}", daemon=False,
        )
        try:
            self.process.start()
            self.ready = self._wait_ready(ready_sock, startup_timeout)
        except BaseException:
            ready_sock.close(0)
            self._kill()
            self._close_sockets()
            raise
        ready_sock.close(0)
        self.alive = True

    def _wait_ready(self, sock: zmq.Socket, timeout: float) -> CoreReady:
        deadline = time.monotonic() + timeout
        while True:
            if sock.poll(200):
                ready = decode_ready(sock.recv())
                if ready.ok:
                    return ready
                self.process.join(10)
                if ready.error_is_value_error:
                    raise ValueError(ready.error)
                raise EngineCoreStartError(f"The engine core failed to start:\n{ready.error}")
            if not self.process.is_alive():
                raise EngineCoreStartError(
                    f"The engine core process exited during start-up (exit code "
                    f"{self.process.exitcode}); see its output above.")
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
        sock = self._output
        while not self._stopping:
            try:
                if not sock.poll(100):
                    continue
                data = sock.recv(copy=False)
            except zmq.ZMQError:
                return  # closed at shutdown
            self._delivery.call(on_outputs, decode_outputs(data.buffer))

    def _watch_process(self, on_death: OnDeath) -> None:
        multiprocessing.connection.wait([self.process.sentinel])
        self.process.join(1)  # reaps it: exitcode is set
        self.alive = False
        if not self._stopping:
            code = self.process.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            logger.error("Engine core %d (pid %d) died: %s", self.engine_index,
                         self.process.pid, how)
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
        if not self._stopping and self.process.is_alive():
            try:
                self._send(EngineCoreRequestType.SHUTDOWN, None)
            except zmq.ZMQError:
                pass
        self._stopping = True
        self._delivery.closed = True
        self.process.join(timeout)
        self._kill()
        self._close_sockets()
        self.alive = False

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
        self._ctx.term()
        if self._own_dir:
            shutil.rmtree(self._dir, ignore_errors=True)

"""The pooling engine in its own process, as the generation core runs in its own: the server's
front end validates and tokenizes (`PoolingInputs`), this process holds the model and the
continuous loop. They talk over a private `multiprocessing` pipe (an anonymous socket pair
between parent and spawned child): in, `("add", params, work)`, `("abort", request_id)`,
`("stop",)`; out, `("ready", startup_s)`, `("outputs", [(request_id, float32 ndarray,
prompt tokens)])`, `("error", request_id, message)` (that request's fault: a 400),
`("fatal", message)` (the loop cannot go on: the process exits 1 after saying so)."""

from __future__ import annotations

import logging
import os
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm.pooling")


def run_pooling_core(config: EngineConfig, conn: Connection) -> None:
    """The child's main: build the engine, say ready, then loop until told to stop or the
    parent is gone (its end of the pipe closes)."""
    from pagedllm.pooling.engine import PoolingEngine

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        engine = PoolingEngine(config)
    except BaseException as exc:  # reported to the parent, which exits 2
        conn.send(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", engine.startup_seconds))
    try:
        _loop(engine, conn)
    except (EOFError, OSError, BrokenPipeError):
        pass  # the parent is gone
    except BaseException as exc:
        logger.exception("pooling core failed")
        try:
            conn.send(("fatal", f"The pooling engine failed: {exc!r}"))
        except OSError:
            pass
        os._exit(1)


def _loop(engine: Any, conn: Connection) -> None:
    while True:
        # idle: wait for work; busy: take what has arrived, then step
        if engine.has_unfinished_requests():
            ready = conn.poll(0)
        else:
            ready = conn.poll(None)
        while ready:
            msg = conn.recv()
            kind = msg[0]
            if kind == "stop":
                return
            if kind == "add":
                _, params, work = msg
                try:
                    engine.add_prepared(params, work)
                except ValueError as exc:
                    conn.send(("error", work.request_id, str(exc)))
            elif kind == "abort":
                engine.abort_request(msg[1])
            ready = conn.poll(0)
        if engine.has_unfinished_requests():
            outs = engine.step()
            if outs:
                conn.send(("outputs", [(o.request_id, o.outputs.data.numpy(), len(o.prompt_token_ids))
                                       for o in outs]))


class PoolingCoreClient:
    """The front end's handle on the core process: `send` from any thread; a reader thread
    hands every message to `on_message`, and `on_exit(reason)` once the process is gone."""

    def __init__(self, config: EngineConfig, on_message: Callable[[tuple], None],
                 on_exit: Callable[[str], None], startup_timeout_s: float = 600.0) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=run_pooling_core, args=(config, child), name="pagedllm-pooling-core",
                                   daemon=True)
        self.process.start()
        child.close()
        if not self._conn.poll(startup_timeout_s):
            self.process.kill()
            raise RuntimeError(f"the pooling core did not start in {startup_timeout_s:.0f} s")
        try:
            first = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the pooling core exited with {self.process.exitcode} during start-up") from None
        if first[0] != "ready":
            self.process.join(10)
            raise ValueError(first[1])
        self.startup_seconds = first[1]
        self._send_lock = threading.Lock()
        self._on_message, self._on_exit = on_message, on_exit
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="pagedllm-pooling-reader", daemon=True)
        self._reader.start()

    def send(self, msg: tuple) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _read(self) -> None:
        reason = "The pooling engine process exited."
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "fatal":
                reason = msg[1]
                continue
            try:
                self._on_message(msg)
            except Exception:  # a bug in the handler must not silence the pipe
                logger.exception("handling a pooling core message failed")
        self.process.join(5)
        if not self._closing:
            self._on_exit(f"{reason} (exit code {self.process.exitcode})")

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        try:
            self.send(("stop",))
        except OSError:
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()

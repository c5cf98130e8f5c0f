"""Grammar compilation in a child process, with a time limit.

xgrammar compiles a constraint for a tokenizer in C++; some constraints take minutes and
gigabytes (a JSON schema `enum` of 100,000 strings ran for over 5 minutes at 100% of both
cores), and a thread cannot be stopped. So compilation runs in a spawned child process that
holds the `GrammarCompiler`; the engine core talks to it from one service thread:

    core's busy loop -- submit(constraint) --> Future        (never blocks)
    service thread   -- (kind, text, any_whitespace) --> child: compile, serialize_json
                     <-- ("ok", json) / ("error", message) --
                     -> CompiledGrammar.deserialize_json -> the Future

A job that takes longer than `timeout_s` kills the child (its memory goes with it): the future
fails with a ValueError (the client's 400) and the next job starts a fresh child. The child
starts on the first job (about 3 s: it imports xgrammar), and the first `TokenizerInfo` is
built on the service thread, never on the busy loop. Equal constraints compile once (an LRU
of compiled grammars in this process).
"""

from __future__ import annotations

import logging
import queue
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
_CACHE_SIZE = 64
_START_TIMEOUT_S = 120.0  # importing xgrammar in the child; a slow disk can take a while


class CompilerProcess:
    """Compiles (kind, text, any_whitespace) jobs in a child process, one at a time, each
    within `timeout_s` seconds. `make_tokenizer_info` runs once, on the service thread."""

    def __init__(self, make_tokenizer_info: Callable[[], Any], timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_threads: int = 2) -> None:
        if not timeout_s > 0:
            raise ValueError(f"structured_outputs_timeout must be positive, got {timeout_s}.")
        self.timeout_s = float(timeout_s)
        self.max_threads = max_threads
        self._make_info = make_tokenizer_info
        self._info = None
        self._info_json: str | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._proc = None
        self._conn = None
        self._closed = False
        self.num_timeouts = 0  # jobs that ran past the limit (their child was killed)

    # ---- any thread -----------------------------------------------------------------------

    def submit(self, key: tuple[str, str, bool]) -> "Future[Any]":
        """The compiled grammar of `key` ((kind, text, any_whitespace), kind one of json,
        regex, grammar, structural_tag) as a future; done at once when cached."""
        fut: Future = Future()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                fut.set_result(cached)
                return fut
            if self._closed:
                fut.set_exception(RuntimeError("The grammar compiler is shut down."))
                return fut
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, daemon=True,
                                                name="pagedllm-grammar-compiler")
                self._thread.start()
        self._jobs.put((key, fut))
        return fut

    def compile(self, key: tuple[str, str, bool]) -> Any:
        """Blocking `submit` (the offline engine's path); the time limit still holds."""
        return self.submit(key).result()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
        self._jobs.put(None)
        self._stop_child()

    # ---- the service thread ---------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            key, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self._compile(key))
            except BaseException as exc:
                fut.set_exception(exc)

    def _compile(self, key: tuple[str, str, bool]) -> Any:
        with self._lock:
            if key in self._cache:  # compiled while this job waited
                return self._cache[key]
        # lazy: xgrammar is optional (pagedllm[structured]) and slow to import (2 s)
        import xgrammar as xgr

        if self._info is None:
            self._info = self._make_info()
            self._info_json = self._info.serialize_json()
        conn = self._child()
        t0 = time.monotonic()
        conn.send(key)
        if not conn.poll(self.timeout_s):
            self.num_timeouts += 1
            self._stop_child()
            raise ValueError(
                f"Compiling the structured_outputs constraint took longer than "
                f"{self.timeout_s:g} s (--structured-outputs-timeout); it was stopped. "
                "Simplify the schema or grammar.")
        try:
            status, payload = conn.recv()
        except (EOFError, OSError) as exc:  # the child died (out of memory, killed)
            self._stop_child()
            raise ValueError(f"The grammar compiler process died while compiling the "
                             f"constraint ({exc!r}).") from None
        if status != "ok":
            raise ValueError(payload)
        compiled = xgr.CompiledGrammar.deserialize_json(payload, self._info)
        logger.debug("Compiled a %s constraint in %.3f s", key[0], time.monotonic() - t0)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _child(self) -> Connection:
        """The running child's link; starts one (a plain subprocess, not multiprocessing's
        spawn, which would re-run an offline user's unguarded script)."""
        if self._proc is not None and self._proc.poll() is None:
            return self._conn
        self._stop_child()
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.structured_output.compiler_child",
             str(theirs.fileno()), str(self.max_threads)],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        conn = Connection(ours.detach())
        self._proc, self._conn = proc, conn
        try:
            conn.send_bytes(self._info_json.encode())
            if not conn.poll(_START_TIMEOUT_S):
                raise RuntimeError("The grammar compiler process did not start within "
                                   f"{_START_TIMEOUT_S:.0f} s.")
            conn.recv()
        except (EOFError, OSError, RuntimeError) as exc:
            self._stop_child()
            raise RuntimeError(f"The grammar compiler process failed to start: {exc}") from None
        return conn

    def _stop_child(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

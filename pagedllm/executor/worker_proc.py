"""A tensor-parallel worker: ranks 1..N-1 (`python -m pagedllm.executor.worker_proc`).

Started by the executor as a fresh interpreter (`subprocess`, spawn semantics: nothing of the
parent's state is inherited; unlike `multiprocessing` it never re-imports the user's main
script, so `LLM(tensor_parallel_size=2)` works from a script without a `__main__` guard, a REPL
or a notebook). It connects back to rank 0 (executor/channel.py), receives its WorkerConfig,
reports each start-up stage, then runs the step loop: decode the step message, run the same
forward as every rank (the collectives synchronise them), no reply. Any exception is sent back
as a traceback before the process exits, so rank 0 can show it. The worker exits when rank 0
says so, when its link closes (the engine's process died), or when its parent process is gone.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.core.step_plan import decode_from_rank0
from pagedllm.executor.channel import connect
from pagedllm.worker.worker import Worker

AUTHKEY_ENV = "PAGEDLLM_TP_AUTHKEY"


def run_worker(conn: Connection, rank: int, config: Any, init_method: str, binding: Any) -> None:
    """Start-up stages (each reported to rank 0), then the step loop until "shutdown"."""
    worker = Worker(config, rank)
    if binding is not None:
        worker.bind_cpu(binding)
    conn.send(("started", rank, os.getpid()))
    worker.init_distributed(init_method)
    worker.load_model()
    conn.send(("loaded", rank))
    while True:
        msg = pickle.loads(conn.recv_bytes())
        kind = msg[0]
        if kind == "step":
            worker.execute_model(decode_from_rank0(msg[1]))
        elif kind == "init_cache":
            worker.initialize_cache(*msg[1:])
            conn.send(("cache_ready", rank))
        elif kind == "profile":
            conn.send(("profiled", rank, worker.profile_memory(*msg[1:])))
        elif kind == "shutdown":
            worker.close()  # only on a clean stop: after a failure the peers may be gone
            return
        else:
            raise RuntimeError(f"unknown message {kind!r} from rank 0")


def _watch_parent(parent: int) -> None:
    """Exit when the process that started this one is gone (re-parented): no orphans even when
    the engine is killed while this worker is busy."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)


def main(argv: list[str]) -> int:
    host, port, rank = argv[0], int(argv[1]), int(argv[2])
    logging.basicConfig(level=logging.INFO, format=f"[tp rank {rank}] %(levelname)s %(name)s: %(message)s")
    authkey = bytes.fromhex(os.environ.pop(AUTHKEY_ENV))
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    conn = connect((host, port), authkey)
    try:
        conn.send(("hello", rank, os.getpid()))
        _, config, init_method, binding = conn.recv()
        run_worker(conn, rank, config, init_method, binding)
        return 0
    except (EOFError, ConnectionError):
        return 0  # rank 0 is gone: nothing to report to
    except BaseException:
        try:
            conn.send(("error", rank, traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)  # at once: leaving the group cleanly could wait on peers that are gone


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A core that stops after a fatal error sends that error, then exits at once (`os._exit`).
Its last message must reach the front end before its death does: the 503 of each request then
names the cause, not only "exit code 1". Both halves are real: the core's `_output_thread`
in a spawned process, the front end's `MPCoreClient` reader and watcher here. (On a loaded
core the loss was seen: tests/server/test_fault_injection.py's tensor-parallel case failed 2
runs in 3 before the output socket got a context of its own that is terminated, i.e. flushed,
before `os._exit`; this idle process loses nothing even without it.)"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import threading

import pytest

from pagedllm.engine.core_client import MPCoreClient
from pagedllm.engine.core_messages import EngineCoreOutput, EngineCoreOutputs
from pagedllm.engine.core_process import _output_thread

FATAL = "the engine step failed: RuntimeError('a rank died')"


def _send_last_words_and_exit(addresses, padding: int) -> None:
    """As run_engine_core ends after a fatal error: the outputs, the end mark, join, _exit."""
    out_q: queue.SimpleQueue = queue.SimpleQueue()
    # Many requests in flight: a big last frame, so that it is still being written at exit.
    out_q.put(EngineCoreOutputs(
        [EngineCoreOutput(f"r{i}", [], finished=True, error=FATAL, error_kind="fatal")
         for i in range(padding)], fatal_error=FATAL))
    out_q.put(None)
    sender = threading.Thread(target=_output_thread, args=(addresses, out_q, None))
    sender.start()
    sender.join(5)
    os._exit(1)


@pytest.mark.parametrize("padding", [1, 20000])
def test_the_fatal_error_arrives_before_the_death(tmp_path, padding):
    client = MPCoreClient.__new__(MPCoreClient)
    client.engine_index = 0
    client._own_dir, client._dir = False, str(tmp_path)
    ready = client._bind_sockets(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out",
                                 f"ipc://{tmp_path}/ready")
    ready.close(0)
    client.process = multiprocessing.get_context("spawn").Process(
        target=_send_last_words_and_exit, args=(client.addresses, padding))
    client.process.start()
    client.alive = True
    events: list[tuple[str, object]] = []

    async def main() -> None:
        done = asyncio.Event()

        def on_outputs(outputs: EngineCoreOutputs) -> None:
            events.append(("outputs", (len(outputs.outputs), outputs.fatal_error)))

        def on_death(index: int, how: str) -> None:
            events.append(("death", how))
            done.set()

        client.start(asyncio.get_running_loop(), on_outputs, on_death)
        await asyncio.wait_for(done.wait(), 30)

    try:
        asyncio.run(main())
    finally:
        client.shutdown(timeout=5)
    assert events == [("outputs", (padding, FATAL)), ("death", "exit code 1")]

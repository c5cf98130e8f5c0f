"""The channel between the front end and its engine core process (engine/core_channel.py,
core_process.py, core_client.py): private, authenticated, and one bad frame never stops it.

- A same-user process that connects to the core's sockets without this launch's keys never
  receives a request (it used to get its round-robin share of other users' prompts) and what
  it sends is never read.
- Frames that fail to decode, on the core's input (sent raw on the authenticated socket) and
  on the front end's output reader (`b"\\xc1garbage"`, which used to kill the reader and hang
  every request), are dropped and logged, or answered as their request's error; the next
  request is served.
"""

from __future__ import annotations

import asyncio
import glob
import os
import subprocess
import threading
import time

import msgspec
import pytest
import zmq

from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.core_channel import secure_client
from pagedllm.engine.core_messages import EngineCoreRequestType, encode
from pagedllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    """A real core process behind an AsyncLLMEngine whose event loop runs in a thread (the
    engine delivers to the loop it was started on, so every test uses that one)."""
    eng = AsyncLLMEngine.from_engine_config(
        EngineConfig(max_model_len=256, max_num_seqs=4, kv_cache_space=0.05),
        with_metrics=False, in_process=False)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(_start(eng), loop).result(30)
    eng.test_loop = loop
    yield eng
    asyncio.run_coroutine_threadsafe(eng.shutdown(10), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


async def _start(eng) -> None:
    eng.start()


def run(engine, coro_fn):
    return asyncio.run_coroutine_threadsafe(coro_fn(), engine.test_loop).result(60)


async def _generate(engine, rid: str, max_tokens: int = 3) -> list[int]:
    outs = [o async for o in engine.generate("Hello", SamplingParams(max_tokens=max_tokens,
                                                                     temperature=0), rid)]
    return outs[-1].outputs[0].token_ids


def test_sockets_are_private_and_authenticated(engine):
    client = engine.clients[0]
    assert client.addresses.input.startswith("ipc://")
    folder = os.path.dirname(client.addresses.input[len("ipc://"):])
    assert os.stat(folder).st_mode & 0o777 == 0o700
    ctx = zmq.Context()
    spy = ctx.socket(zmq.PULL)  # an eavesdropper on the input socket, no keys
    spy.connect(client.addresses.input)
    forger = ctx.socket(zmq.PUSH)  # a forger on the output socket, no keys
    forger.connect(client.addresses.output)
    wrong = ctx.socket(zmq.PULL)  # CURVE, the right server key, but not the core's key
    pub, sec = zmq.curve_keypair()
    wrong.curve_serverkey = client.addresses.keys.server_public
    wrong.curve_publickey, wrong.curve_secretkey = pub, sec
    wrong.connect(client.addresses.input)
    try:
        time.sleep(0.5)  # give the handshakes time to fail
        for _ in range(3):
            try:
                forger.send(b"\xc1garbage", zmq.NOBLOCK)
            except zmq.Again:
                pass  # its handshake already failed: no peer takes the frame (not delivered either way)

        async def body():
            return [await _generate(engine, f"private-{i}") for i in range(6)]

        results = run(engine, body)
        assert all(len(ids) == 3 for ids in results)
        assert spy.poll(500) == 0 and wrong.poll(10) == 0  # not one of the 6 requests
        assert client._guard.refused >= 1  # the wrong key was refused by the ZAP handler
    finally:
        for s in (spy, forger, wrong):
            s.close(0)
        ctx.term()


def test_undecodable_frames_are_dropped_or_fail_only_their_request(engine):
    client = engine.clients[0]
    real_add = client.add_request

    def corrupt_add(request):
        # the request as the core would receive it, with n=0 inside: it fails to decode
        raw = msgspec.msgpack.decode(encode(request))
        raw[2]["n"] = 0
        client._input.send_multipart((bytes((int(EngineCoreRequestType.ADD),)),
                                      msgspec.msgpack.encode(raw)))

    async def body():
        # raw garbage on the core's input, through the authenticated socket
        client._input.send_multipart((b"\x00", b"\xc1garbage"))
        client._input.send_multipart((b"\x09", b"\x90"))  # an unknown kind
        client._input.send_multipart((b"\x00",))  # one frame
        client.add_request = corrupt_add
        try:
            with pytest.raises(ValueError, match="could not read this request.*n must be"):
                await _generate(engine, "corrupt")
        finally:
            client.add_request = real_add
        # garbage on the front end's output reader, from a peer with the core's keys
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        secure_client(push, client.addresses.keys)
        push.connect(client.addresses.output)
        push.send(b"\xc1garbage")
        push.close(linger=1000)
        ctx.term()
        await asyncio.sleep(0.3)
        assert client._reader.is_alive()
        t0 = time.monotonic()
        ids = await _generate(engine, "after")
        assert len(ids) == 3 and time.monotonic() - t0 < 10
        assert engine.health_problem() is None

    run(engine, body)


def test_no_socket_folder_outlives_a_clean_shutdown_and_stale_ones_are_swept():
    """A SIGKILLed server cannot remove its folder: the next one removes the folders whose
    server pid is gone (and leaves live servers' folders alone)."""
    import tempfile

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tempfile.mkdtemp(prefix=f"pagedllm-core-{dead.pid}-")
    live = tempfile.mkdtemp(prefix=f"pagedllm-core-{os.getpid()}-")
    before = set(glob.glob("/tmp/pagedllm-core-*")) - {stale}
    eng = AsyncLLMEngine.from_engine_config(
        EngineConfig(max_model_len=128, max_num_seqs=2, kv_cache_space=0.02),
        with_metrics=False, in_process=False)
    folder = os.path.dirname(eng.clients[0].addresses.input[len("ipc://"):])
    assert os.path.isdir(folder)
    for c in eng.clients:
        c.shutdown(10)
    assert not os.path.exists(folder) and not os.path.exists(stale) and os.path.isdir(live)
    os.rmdir(live)
    assert set(glob.glob("/tmp/pagedllm-core-*")) <= before

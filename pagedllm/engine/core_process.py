"""The engine core in its own process, behind ZeroMQ (vLLM v1's EngineCoreProc).

    front end (API server)                          engine core process
    PUSH input  --(kind frame, msgpack frame)-->    PULL: input thread -> CoreBusyLoop queue
    PULL output <--(msgpack EngineCoreOutputs)--    PUSH: output thread <- CoreBusyLoop.send
    PULL ready  <--(msgpack CoreReady, once)----    PUSH: after the model loaded (or failed)

The front end binds the sockets (ipc:// in a private temporary folder) and starts the process
with `spawn` (no inherited threads or CUDA state); the core connects. Two threads move bytes so
that the busy loop never waits on a socket: the input thread decodes messages into the loop's
queue, the output thread encodes and sends what the loop produced (ZeroMQ sends and receives
release the GIL). The core exits when told (SHUTDOWN), on SIGTERM / SIGINT of its own, or when
the front end's process is gone (it polls its parent once a second), so no core outlives its
server.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import zmq

from pagedllm import envs
from pagedllm.engine.core_channel import CoreKeys, secure_client
from pagedllm.engine.core_messages import (
    CoreReady,
    EngineCoreOutputs,
    EngineCoreRequestType,
    decode_any,
    decode_request,
    encode,
    ready_info,
    request_id_of,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreAddresses:
    """Where the core connects, and the keys it authenticates with (engine/core_channel.py)."""

    input: str
    output: str
    ready: str
    keys: CoreKeys | None = None


def connect(ctx: zmq.Context, kind: int, address: str, keys: CoreKeys | None) -> zmq.Socket:
    sock = ctx.socket(kind)
    if keys is not None:
        secure_client(sock, keys)
    sock.connect(address)
    return sock


def run_engine_core(config, engine_index: int, addresses: CoreAddresses,
                    parent_pid: int | None, log_level: int = logging.INFO,
                    handle_signals: bool = True) -> None:
    """The core process's main function (a `multiprocessing` spawn target, or the `run` of a
    Ray actor: then `parent_pid` is None, Ray ends the actor with its owner, and Ray keeps
    its own signal handlers)."""
    logging.basicConfig(level=log_level,
                        format=f"%(levelname)s %(name)s [core {engine_index}]: %(message)s")
    if handle_signals:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides; Ctrl-C reaches both
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    ctx = zmq.Context()
    ready = ctx.socket(zmq.PUSH)
    ready.setsockopt(zmq.LINGER, 5000)
    if addresses.keys is not None:
        secure_client(ready, addresses.keys)
    ready.connect(addresses.ready)
    try:
        from pagedllm.engine.core import EngineCore
        from pagedllm.kernels.status import kernel_status

        _bind_replica(config, engine_index)
        core = EngineCore(config, engine_index)
        info = kernel_status().info_labels() if core.device.type == "cpu" else {}
    except BaseException as exc:  # the front end prints it and exits
        ready.send(encode(CoreReady(
            ok=False, error=str(exc) if isinstance(exc, ValueError) else traceback.format_exc(),
            error_is_value_error=isinstance(exc, ValueError), pid=os.getpid(),
        )))
        ready.close()
        ctx.term()
        sys.exit(1)
    out_q: queue.SimpleQueue[EngineCoreOutputs | None] = queue.SimpleQueue()
    from pagedllm.engine.core_loop import CoreBusyLoop

    loop = CoreBusyLoop(core, out_q.put, engine_index)
    threading.Thread(target=_exit_if_it_fails, args=(_input_thread, ctx, addresses, loop),
                     name="pagedllm-core-input", daemon=True).start()
    sender = threading.Thread(target=_exit_if_it_fails,
                              args=(_output_thread, addresses, out_q, loop),
                              name="pagedllm-core-output", daemon=True)
    sender.start()
    hand_shake = ready_info(core)
    hand_shake.kernel_info = info
    ready.send(encode(hand_shake))
    ready.close()
    try:
        loop.run()
    except BaseException:
        logger.exception("The engine core's loop died")
        out_q.put(None)
        sender.join(5)
        os._exit(1)
    out_q.put(None)
    sender.join(5)
    os._exit(0)


def _bind_replica(config, engine_index: int) -> None:
    """CPU, data parallelism: replica i of M takes its own `cores // M` cores (as tensor-parallel
    ranks do), so that M replicas' thread pools do not fight over every core."""
    replicas = getattr(config, "data_parallel_size", 1)
    if replicas <= 1:
        return
    from pagedllm.worker.device import resolve_device

    if resolve_device(config.device).type != "cpu":
        return
    if config.distributed_executor_backend == "ray":
        # Ray placed this replica on a node and gave it its bundle's CPUs: use that many.
        import torch

        if config.num_threads is None:
            torch.set_num_threads(max(1, int(envs.PAGEDLLM_RAY_CPUS_PER_REPLICA)))
        return
    from pagedllm.distributed import cpu_binding

    threads = config.num_threads if config.tensor_parallel_size == 1 else None
    binding = cpu_binding.rank_binding(engine_index, replicas, cpu_binding.available_cores(),
                                       threads)
    cpu_binding.apply(binding, engine_index, role="data-parallel replica")


def _exit_if_it_fails(target, *args) -> None:
    """A socket thread that dies leaves a process that no longer listens (or speaks): exit
    instead, so that the front end sees the core end and answers 503 (never a deaf core)."""
    try:
        target(*args)
    except BaseException:
        logger.exception("The engine core's %s thread died; the core exits",
                         threading.current_thread().name)
        os._exit(1)


def _input_thread(ctx: zmq.Context, addresses: CoreAddresses, loop) -> None:
    """Each message on its own: one that cannot be read is answered (its request fails with
    a 400) or dropped and logged, and the thread goes on."""
    sock = connect(ctx, zmq.PULL, addresses.input, addresses.keys)
    while True:
        frames = sock.recv_multipart(copy=False)
        try:
            kind, payload = _read_message(frames)
        except Exception as exc:
            _reject_message(frames, exc, loop)
            continue
        loop.put(kind, payload)
        if kind == EngineCoreRequestType.SHUTDOWN:
            return


def _read_message(frames) -> tuple[EngineCoreRequestType, object]:
    if len(frames) != 2 or len(frames[0].buffer) != 1:
        raise ValueError(f"expected 2 frames (kind, payload), got {len(frames)}")
    kind = EngineCoreRequestType(bytes(frames[0].buffer)[0])
    data = frames[1].buffer
    if kind == EngineCoreRequestType.ADD:
        return kind, decode_request(data)
    return kind, decode_any(data)


def _reject_message(frames, exc: Exception, loop) -> None:
    request_id = request_id_of(frames[-1].buffer) if frames else None
    reason = str(exc) or type(exc).__name__
    if request_id is None:
        logger.error("Dropped a message the engine core could not read: %s", reason)
        return
    logger.warning("Request %s: its message could not be read: %s", request_id, reason)
    loop.reject(request_id, f"The engine core could not read this request: {reason}")


def _output_thread(addresses: CoreAddresses, out_q: queue.SimpleQueue,
                   loop) -> None:
    """Encodes and sends; outputs that cannot be encoded fail their requests instead (and
    the loop aborts them), so that no client waits for outputs that never come.

    The socket has a context of its own: at the end, terminating it waits (up to the linger)
    until the last outputs have left, a fatal error's above all, before the process exits
    (`os._exit` would otherwise kill ZeroMQ's I/O thread with them still queued)."""
    own_ctx = zmq.Context()
    sock = own_ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 2000)
    if addresses.keys is not None:
        secure_client(sock, addresses.keys)
    sock.connect(addresses.output)
    while True:
        outputs = out_q.get()
        if outputs is None:
            sock.close()
            own_ctx.term()
            return
        try:
            frame = encode(outputs)
        except Exception as exc:
            logger.exception("Could not encode the engine core's outputs")
            frame = encode(_unencodable(outputs, exc))
            loop.put(EngineCoreRequestType.ABORT, [o.request_id for o in outputs.outputs])
        sock.send(frame, copy=False)


def _unencodable(outputs: EngineCoreOutputs, exc: Exception) -> EngineCoreOutputs:
    from pagedllm.engine.core_messages import EngineCoreOutput

    message = f"The engine core could not send this request's output: {exc!r}"
    return EngineCoreOutputs(
        [EngineCoreOutput(o.request_id, [], finished=True, error=message,
                          error_kind="internal") for o in outputs.outputs],
        timestamp=outputs.timestamp, engine_index=outputs.engine_index,
        utility_result=outputs.utility_result, health_error=outputs.health_error,
        fatal_error=outputs.fatal_error)


def _exit_with_parent(parent_pid: int) -> None:
    """Leave when the front end is gone (SIGKILLed servers must not leave cores behind)."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="pagedllm-parent-watch", daemon=True).start()

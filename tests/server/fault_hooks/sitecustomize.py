"""Fault injection for the tests, loaded by every Python process a test starts with this folder
on PYTHONPATH (the server, its engine core, tensor-parallel workers). Test code, never part of
the product (pagedllm has no fault hooks of its own).

- PAGEDLLM_TEST_FAULT=KIND (tests/server/test_fault_injection.py): patches the engine core's
  code so that requests whose prompt ends with token FAULT_MARK fail at one chosen point. Only
  the core process ever calls the patched functions.
- PAGEDLLM_TEST_WORKER_FAULT=RANK:STAGE (`inject_worker_fault`): in the tensor-parallel worker
  process of that rank (`python -m pagedllm.executor.worker_proc HOST PORT RANK`),
  `Worker.load_model` ("load") or `Worker.execute_model` ("step") raises `InjectedFault`:
  a worker's own traceback must reach the engine and the client."""

from __future__ import annotations

import os
import sys
from pathlib import Path

FAULT = os.environ.get("PAGEDLLM_TEST_FAULT")
FAULT_MARK = 4242
_marked: set[str] = set()


def _install() -> None:
    from pagedllm.engine import core_loop, core_process
    from pagedllm.engine.core_messages import EngineCoreOutputs, EngineCoreRequestType

    read = core_process._read_message

    def read_message(frames):
        kind, payload = read(frames)
        if kind == EngineCoreRequestType.ADD and payload.prompt_token_ids[-1] == FAULT_MARK:
            _marked.add(payload.request_id)
            if FAULT == "input_message":
                raise ValueError("injected: this message cannot be read")
            if FAULT == "forward":
                _patch_forward()
        return kind, payload

    core_process._read_message = read_message

    if FAULT == "input_thread":
        put = core_loop.CoreBusyLoop.put

        def failing_put(self, kind, payload):
            if kind == EngineCoreRequestType.ADD and payload.request_id in _marked:
                raise RuntimeError("injected: the input thread fails outside a message")
            return put(self, kind, payload)

        core_loop.CoreBusyLoop.put = failing_put

    if FAULT in ("output_message", "output_thread"):
        encode = core_process.encode

        def failing_encode(obj):
            if isinstance(obj, EngineCoreOutputs) and any(
                    o.request_id in _marked and o.error is None for o in obj.outputs):
                raise RuntimeError("injected: these outputs cannot be encoded")
            return encode(obj)

        core_process.encode = failing_encode
        if FAULT == "output_thread":
            def failing_unencodable(outputs, exc):
                raise RuntimeError("injected: the output thread fails outside a message")

            core_process._unencodable = failing_unencodable


def _patch_forward() -> None:
    from pagedllm.worker.model_runner import ModelRunner

    def failing_execute(self, scheduler_output):
        raise RuntimeError("injected: the forward failed")

    ModelRunner.execute_model = failing_execute


WORKER_FAULT_ENV = "PAGEDLLM_TEST_WORKER_FAULT"
HOOKS = str(Path(__file__).parent)


class InjectedFault(RuntimeError):
    pass


def inject_worker_fault(monkeypatch, spec: str) -> None:
    """Make tensor-parallel worker RANK fail at STAGE ("load" or "step") in the processes the
    test starts from now on (`spec` = "RANK:STAGE")."""
    monkeypatch.setenv(WORKER_FAULT_ENV, spec)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (HOOKS, str(Path(__file__).parents[3]), os.environ.get("PYTHONPATH")) if p))


def _install_worker_fault(rank: str, stage: str) -> None:
    from pagedllm.worker.worker import Worker

    method = {"load": "load_model", "step": "execute_model"}[stage]
    original = getattr(Worker, method)

    def faulty(self, *args, **kwargs):
        if str(self.rank) == rank:
            raise InjectedFault(f"fault injected by {WORKER_FAULT_ENV}={rank}:{stage}")
        return original(self, *args, **kwargs)

    setattr(Worker, method, faulty)


if FAULT:
    _install()
_WORKER_FAULT = os.environ.get(WORKER_FAULT_ENV, "")
_ARGV = getattr(sys, "orig_argv", [])
if _WORKER_FAULT and "pagedllm.executor.worker_proc" in _ARGV and _ARGV[-1] == _WORKER_FAULT.split(":")[0]:
    _install_worker_fault(*_WORKER_FAULT.split(":"))

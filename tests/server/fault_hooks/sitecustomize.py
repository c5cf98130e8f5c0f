"""Fault injection for tests/server/test_fault_injection.py, loaded by every Python process the
test starts with this folder on PYTHONPATH (the server and its engine core): with
PAGEDLLM_TEST_FAULT set, it patches the engine core's code so that requests whose prompt ends
with token FAULT_MARK fail at one chosen point. Only the core process ever calls the patched
functions. Test code, never part of the product."""

from __future__ import annotations

import os

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


if FAULT:
    _install()

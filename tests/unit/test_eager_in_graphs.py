"""layers/eager_in_graphs.py: functions stay eager inside compiled graphs, and start-up no longer
imports torch._dynamo (about 1 s per server, core and worker process)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedllm.layers.eager_in_graphs import eager_in_graphs, prepare_for_compilation

_ENGINE_MODULES = ("pagedllm.entrypoints.openai.api_server", "pagedllm.engine.core_process",
                   "pagedllm.engine.core", "pagedllm.worker.model_runner", "pagedllm.model.llama",
                   "pagedllm.layers.moe", "pagedllm.executor.worker_proc", "pagedllm.llm")


@pytest.mark.slow  # a fresh interpreter importing the engine: 6 s
def test_the_engine_imports_without_torch_dynamo():
    code = f"import sys\nimport {', '.join(_ENGINE_MODULES)}\nprint('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


calls: list[str] = []


@eager_in_graphs  # made at import, before any preparation (as the layers' functions are)
def early(x: torch.Tensor) -> torch.Tensor:
    calls.append("early")
    return x * 2


def test_prepared_functions_run_eagerly_in_every_compiled_call():
    from torch._dynamo.testing import CompileCounter

    prepare_for_compilation()

    @eager_in_graphs  # made after it: disabled at once
    def late(x: torch.Tensor) -> torch.Tensor:
        calls.append("late")
        return x - 1

    def step(x: torch.Tensor) -> torch.Tensor:
        return late(early(x + 1)) * 3

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter)
    calls.clear()
    for _ in range(3):
        assert torch.equal(compiled(torch.ones(4)), torch.full((4,), 9.0))
    assert calls == ["early", "late"] * 3  # eager each time, not traced once into the graph
    assert counter.frame_count == 2  # graphs before and after them

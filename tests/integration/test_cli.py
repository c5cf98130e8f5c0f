"""`pagedllm generate` end to end in a subprocess, and a start-up error for a bad knob."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_generate_prints_completions(smollm2_gguf):
    proc = _run("generate", "--model", smollm2_gguf, "--kv-cache-space", "0.2", "--max-tokens",
                "8", "--ignore-eos", "The capital of France is", "1, 2, 3,")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("=== Prompt:") == 2
    assert proc.stdout.count("(8 tokens, finish_reason=length)") == 2
    assert "KV cache: peak" in proc.stdout
    assert "KV cache:" in proc.stderr and "maximum concurrency" in proc.stderr


def test_unsupported_knob_is_a_clear_error(smollm2_gguf):
    proc = _run("generate", "--model", smollm2_gguf, "--tensor-parallel-size", "2", "hi")
    assert proc.returncode == 2
    assert "tensor_parallel_size=2 does not divide the model's 9 attention heads" in proc.stderr


def test_unit_engine_config_rejects_unknown_kwarg():
    import pytest

    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match=r"Unknown engine argument\(s\) \['blok_size'\]"):
        EngineConfig.from_kwargs(blok_size=16)
    with pytest.raises(ValueError, match="block_size must be one of"):
        EngineConfig(block_size=12)
    with pytest.raises(ValueError, match="quantization='bitsandbytes' is not supported"):
        EngineConfig(quantization="bitsandbytes")


def test_bench_subcommand_runs_a_benchmark(smollm2_gguf):
    proc = _run("bench", "latency", "--model", smollm2_gguf, "--batch-size", "1",
                "--input-len", "4", "--output-len", "3", "--num-iters", "1",
                "--kv-cache-space", "0.05")
    assert proc.returncode == 0, proc.stderr
    import json

    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["batch_size"] == 1 and result["decode_step_ms"] > 0

"""Who runs the model (docs/tensor_parallel.md): `create_executor` picks the executor for an
engine configuration: one rank in process (`UniprocExecutor`), or tensor-parallel ranks as
worker processes (`MultiprocExecutor`, `distributed_executor_backend="mp"`) or Ray actors
(`RayExecutor`, "ray")."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm import envs
from pagedllm.core.kv_cache_groups import hybrid_kv_cache_groups
from pagedllm.executor.base import Executor
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.ray_executor import RayExecutor
from pagedllm.executor.uniproc import UniprocExecutor
from pagedllm.lora.worker_manager import LoRAWorkerConfig
from pagedllm.model.registry import get_model_class
from pagedllm.worker.cuda_graphs import capture_sizes
from pagedllm.worker.worker import WorkerConfig


def worker_config(config: Any, model_path: str, gguf_file: str | None, hf_config: Any, dtype: torch.dtype,
                  device: torch.device, kv_cache_dtype: torch.dtype) -> WorkerConfig:
    """What every rank needs, from the engine's configuration and what it resolved."""
    groups = kv_cache_groups(config, hf_config)
    hybrid = groups is not None and groups.is_hybrid  # one sliding group keeps one table
    if hybrid and config.cuda_graph_sizes and not config.enforce_eager:
        raise ValueError("cuda_graph_sizes is not supported with a hybrid KV cache yet (its graphs read one "
                         "block table); drop it, or pass disable_hybrid_kv_cache_manager=True")
    return WorkerConfig(
        model_path=model_path, gguf_file=gguf_file, hf_config=hf_config, dtype=dtype,
        device_type=torch.device(device).type, kv_cache_dtype=kv_cache_dtype, block_size=config.block_size,
        seed=config.seed, quantization=config.quantization, quant_compute=config.quant_compute,
        tensor_parallel_size=config.tensor_parallel_size, num_threads=config.num_threads,
        # how long a rank waits in a collective for the others (a hung peer; a dead one is seen at once)
        collective_timeout_s=envs.PAGEDLLM_TP_TIMEOUT_S,
        attention_backend=config.attention_backend, kv_cache_groups=groups,
        # CUDA graphs read one block table: a hybrid cache's decode steps run eager for now; so
        # do LoRA's (the graphs would not see the step's adapter indices)
        cuda_graph_sizes=None if hybrid or getattr(config, "enable_lora", False) else cuda_graph_sizes(config, device),
        lora=lora_worker_config(config), enforce_eager=bool(config.enforce_eager),
    )


def lora_worker_config(config: Any):
    """The LoRA knobs every rank needs (None: LoRA off)."""
    if not getattr(config, "enable_lora", False):
        return None

    return LoRAWorkerConfig(config.max_loras, config.max_lora_rank, config.resolved_max_cpu_loras)


def kv_cache_groups(config: Any, hf_config: Any):
    """The model's hybrid KV cache groups, unless disabled (None: one table for all layers)."""
    return hybrid_kv_cache_groups(hf_config, getattr(config, "disable_hybrid_kv_cache_manager", False))


def cuda_graph_sizes(config: Any, device: torch.device) -> list[int] | None:
    """The decode buckets to capture: on a GPU unless enforce_eager (the worker drops them where
    its attention backend is not capture-safe)."""
    if config.enforce_eager or torch.device(device).type != "cuda":
        return None

    return capture_sizes(config.max_num_seqs, config.cuda_graph_sizes)


def create_executor(config: Any, model_path: str, gguf_file: str | None, hf_config: Any, dtype: torch.dtype,
                    device: torch.device, kv_cache_dtype: torch.dtype, draft: Any = None) -> Executor:
    """The executor for `config` (an EngineConfig), with every rank's weights loaded; the model
    is checked to split over `tensor_parallel_size` ranks before any worker starts."""
    wc = worker_config(config, model_path, gguf_file, hf_config, dtype, device, kv_cache_dtype)
    wc.draft = draft  # a speculative draft model (rank 0 only: the engine refuses it under TP)
    if config.tensor_parallel_size == 1:
        return UniprocExecutor(wc)

    get_model_class(hf_config).check_tensor_parallel(hf_config, config.tensor_parallel_size)
    backend = getattr(config, "distributed_executor_backend", "mp")
    if backend == "ray":
        return RayExecutor(wc)

    return MultiprocExecutor(wc)


__all__ = ["Executor", "create_executor", "worker_config"]

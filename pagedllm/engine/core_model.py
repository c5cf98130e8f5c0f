"""The engine core's model and KV pool at start-up: who runs the model (the executor), how long
a sequence may be, how the KV cache is grouped, how many blocks the pool holds. One function for
both kinds of core: a generation model, or a pooling model (engine/core_pooling.py), whose
decoders load without their LM head and never decode (no decode graphs), and whose encoders run
in `pooling/encoder_runner.py` with a bookkeeping-only pool."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_groups import KVCacheGroups, hybrid_kv_cache_groups
from pagedllm.engine.core_pooling import CorePooling
from pagedllm.engine.core_startup import bytes_per_block, log_cache_size, resolve_max_model_len, size_block_pool
from pagedllm.executor import create_executor
from pagedllm.model_source import ModelSource
from pagedllm.worker.memory_sizing import MemoryProfile


@dataclass
class ModelParts:
    executor: Any
    max_model_len: int
    kv_cache_groups: KVCacheGroups | None
    bytes_per_block: int
    num_blocks: int
    memory_profile: MemoryProfile | None
    num_host_blocks: int


def start_model(config: EngineConfig, source: ModelSource, hf_config: Any, dtype: torch.dtype,
                device: torch.device, kv_cache_dtype: torch.dtype, draft: Any,
                pooling: CorePooling | None) -> ModelParts:
    """Load every rank's weights, then size the block pool (GPU: by a profile step)."""
    if pooling is not None and pooling.is_encoder:
        from pagedllm.pooling.encoder_runner import EncoderRunner

        runner = EncoderRunner(source.path, hf_config, pooling.inputs.architecture, dtype, device)
        return ModelParts(runner, pooling.max_model_len, None, 0, pooling.encoder_pool_blocks(), None, 0)
    model_config, max_model_len = hf_config, None
    if pooling is not None:
        model_config, max_model_len = pooling.model_config(hf_config), pooling.max_model_len
        config = dataclasses.replace(config, enforce_eager=True)  # prefill only: nothing to compile
    # Every rank's weights (tensor parallelism: worker processes load their shards meanwhile).
    executor = create_executor(config, source.path, source.gguf_file, model_config, dtype, device,
                               kv_cache_dtype, draft=draft)
    if max_model_len is None:
        max_model_len = resolve_max_model_len(hf_config, config.max_model_len)
    # Layers grouped by attention type when the model mixes them (docs/hybrid_kv_cache.md):
    # a block then holds `slots` layers, and sliding groups keep only their window.
    groups = hybrid_kv_cache_groups(hf_config, config.disable_hybrid_kv_cache_manager)
    # One block over every layer (a hybrid cache's: over its slots), a draft model's too.
    per_block = bytes_per_block(hf_config, groups, draft, config.block_size, kv_cache_dtype)
    # GPU: the pool is what the profile (memory_profile) leaves; CPU: kv_cache_space.
    num_blocks, profile = size_block_pool(config, executor, device, per_block, max_model_len)
    num_host_blocks = int(config.swap_space * (1 << 30)) // per_block
    log_cache_size(config, groups, kv_cache_dtype, per_block, num_blocks, num_host_blocks, max_model_len)
    return ModelParts(executor, max_model_len, groups, per_block, num_blocks, profile, num_host_blocks)

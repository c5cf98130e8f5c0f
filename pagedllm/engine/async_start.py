"""The server's engine start: launch (or take) the cores, load the front end's tokenizer while
they load the model, and gather what the front end needs from their hand-shakes (`EngineInfo`,
the /metrics registry; a pooling model's prompt rule, pooling/inputs.py)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from pagedllm.core.kv_cache_groups import hybrid_groups_of_windows
from pagedllm.core.scheduler_config import check_request_fits_pool
from pagedllm.engine.core_messages import CoreReady
from pagedllm.engine.core_start import IN_PROCESS_ENV, CoreStart, in_process_requested
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.generation_defaults import load_generation_defaults
from pagedllm.model.resolution import serving_runner
from pagedllm.multimodal.media import MediaPolicy

logger = logging.getLogger(__name__)


@dataclass
class StartedCores:
    clients: list[Any]
    tokenizer: Any
    info: EngineInfo
    metrics: Any
    ray_replicas: Any
    pooling_inputs: Any  # a pooling model's PoolingInputs; None for a generation model
    multimodal: Any = None  # a multimodal model's processor (multimodal/processing.py)


def check_fits(num_tokens: int, num_lockstep_seqs: int = 1, *, num_blocks: int,
               block_size: int, groups: Any = None, chunk: int = 0) -> None:
    """The front end's copy of the core's rule of what can ever fit in the pool."""
    check_request_fits_pool(num_tokens, num_lockstep_seqs, num_blocks, block_size, groups, chunk)


def _config_vocab_size(source: Any) -> int:
    """The model config's vocabulary size (a core whose hand-shake did not carry one)."""
    from pagedllm.model_source import load_hf_config

    return int(load_hf_config(source).vocab_size)


def start_cores(config: Any, with_metrics: bool, in_process: bool | None, start: CoreStart | None) -> StartedCores:
    """Start the core(s) (or take those `start` launched) and wait until they are ready (a
    ValueError: bad configuration); the tokenizer loads meanwhile."""
    from pagedllm.multimodal.processing import multimodal_processor
    from pagedllm.tokenizer import load_tokenizer

    if start is None:
        if in_process is None:
            in_process = in_process_requested()
        replicas = getattr(config, "data_parallel_size", 1)
        if in_process and replicas != 1:
            raise ValueError(f"{IN_PROCESS_ENV}=1 runs one engine core in this process; "
                             f"data_parallel_size={replicas} needs core processes.")
        start = CoreStart(config, in_process=in_process)
    source, tok_source, config = start.source, start.tok_source, start.config
    pooling_inputs = multimodal = None
    try:
        if serving_runner(config) == "pooling":
            from pagedllm.pooling.inputs import PoolingInputs

            pooling_inputs = PoolingInputs(config)  # the prompt rule: the same tokenizer as the core's model
            tokenizer = pooling_inputs.tokenizer
        else:
            tokenizer = load_tokenizer(tok_source.path, tok_source.gguf_file)
            multimodal = multimodal_processor(config, source)
    except BaseException:
        start.abandon()
        raise
    clients = start.clients()
    for c in clients:
        logger.info("Engine core %d ready in %.1f s (pid %d)", c.engine_index,
                    c.ready.startup_seconds, c.ready.pid)
    ready: CoreReady = clients[0].ready
    info = EngineInfo(
        model_name=ready.model_name,
        model_root=os.path.join(source.path, source.gguf_file) if source.gguf_file else source.path,
        max_model_len=ready.max_model_len,
        vocab_size=ready.vocab_size or _config_vocab_size(source),
        num_blocks=min(c.ready.num_blocks for c in clients),
        block_size=ready.block_size,
        chat_template=config.chat_template,
        startup_seconds=max(c.ready.startup_seconds for c in clients),
        kernel_info=ready.kernel_info,
        scheduling_policy=config.scheduling_policy,
        max_logprobs=config.max_logprobs,
        max_num_seqs=config.max_num_seqs,
        generation_defaults=({} if pooling_inputs is not None else
                             load_generation_defaults(config.generation_config, source.path, bool(source.gguf_file))),
        served_model_names=config.served_model_names,
        kv_cache_groups=hybrid_groups_of_windows(ready.hybrid_layer_windows),
        max_num_batched_tokens=ready.max_num_batched_tokens,
        takes_images=multimodal is not None,
        limit_mm_per_prompt=dict(config.limit_mm_per_prompt or {}),
        media_policy=MediaPolicy.from_config(config),
    )
    if pooling_inputs is not None and not pooling_inputs.is_encoder:
        pooling_inputs.num_kv_blocks = info.num_blocks
    metrics = None
    if with_metrics:
        from pagedllm.metrics import EngineMetrics, cache_config_labels, kv_cache_group_attention

        metrics = EngineMetrics(
            info.model_name, num_engines=len(clients), kernel_info=info.kernel_info or None,
            max_model_len=info.max_model_len,
            cache_info=[cache_config_labels(config, c.ready.num_blocks, c.ready.block_size) for c in clients],
            kv_cache_group_attention=kv_cache_group_attention(info.kv_cache_groups))
    return StartedCores(clients, tokenizer, info, metrics, start.ray_replicas, pooling_inputs, multimodal)

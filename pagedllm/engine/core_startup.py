"""What the engine core settles once at start-up: the context length, the block's bytes, how
many blocks the pool gets, the draft model, the EOS ids. Functions of the configuration, the
model's config and (on a GPU) a profile step, so that `EngineCore.__init__` reads as the list of
its parts."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_groups import KVCacheGroups, hybrid_kv_cache_groups
from pagedllm.core.scheduler_config import SchedulerConfig
from pagedllm.layers.rotary import long_context_threshold
from pagedllm.model_source import ModelSource, load_hf_config, resolve_model
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.worker.memory_sizing import MemoryProfile, size_kv_cache
from pagedllm.worker.worker import DraftModelConfig

logger = logging.getLogger(__name__)


def resolve_max_model_len(hf_config: Any, wanted: int | None) -> int:
    model_max = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    if wanted is None:
        return model_max or 2048
    if model_max and wanted > model_max:
        raise ValueError(
            f"max_model_len={wanted} is larger than the model's maximum context length "
            f"(max_position_embeddings={model_max})."
        )
    return wanted


def model_block_bytes(cfg: Any, layers: int, block_size: int, kv_cache_dtype: torch.dtype) -> int:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return CacheEngine.bytes_per_block(layers, kv_heads, head_dim, block_size, kv_cache_dtype)


def bytes_per_block(hf_config: Any, groups: KVCacheGroups | None, draft: DraftModelConfig | None,
                    block_size: int, kv_cache_dtype: torch.dtype) -> int:
    """One block over every layer; with a draft model, its layers' K/V of the same block too.
    A hybrid cache's block holds one layer per slot, not every layer."""
    layers = groups.slots if groups else hf_config.num_hidden_layers
    per_block = model_block_bytes(hf_config, layers, block_size, kv_cache_dtype)
    if draft is not None:
        per_block += model_block_bytes(draft.hf_config, draft.hf_config.num_hidden_layers, block_size, kv_cache_dtype)
    return per_block


def draft_model_config(config: EngineConfig, hf_config: Any, spec: SpeculativeConfig) -> DraftModelConfig:
    """The draft model of `speculative_config` (method draft_model), checked against the
    target: one process (no tensor parallelism), one block table (no hybrid or sliding KV
    cache groups: their freed blocks would be the draft's too), the target's vocabulary."""
    if config.enable_lora:
        raise ValueError("speculative method 'draft_model' with enable_lora is not built in pagedllm yet "
                         "(the draft would run without the adapters); use method 'ngram' or 'suffix'.")
    if getattr(hf_config, "multimodal_config", None) is not None:
        raise ValueError("speculative method 'draft_model' with an image model is not built in pagedllm yet "
                         "(the draft would see placeholder tokens without the image); use method 'ngram' or "
                         "'suffix'.")
    if config.tensor_parallel_size > 1:
        raise ValueError("speculative method 'draft_model' with tensor_parallel_size > 1 is not built in "
                         "pagedllm yet (the draft runs beside rank 0's shard); use method 'ngram' or one rank.")
    if hybrid_kv_cache_groups(hf_config, config.disable_hybrid_kv_cache_manager) is not None:
        raise ValueError("speculative method 'draft_model' is not built for a model with sliding-window "
                         "KV cache groups (the draft's K/V would lose the blocks the window frees); pass "
                         "disable_hybrid_kv_cache_manager=True, or use method 'ngram'.")
    source = resolve_model(spec.model, revision=spec.revision, download_dir=config.download_dir)
    draft_hf_config = load_hf_config(source)
    draft_vocab = int(getattr(draft_hf_config, "vocab_size", 0) or 0)
    vocab = int(hf_config.vocab_size)
    if draft_vocab != vocab:
        raise ValueError(f"the draft model {spec.model!r} has a vocabulary of {draft_vocab} tokens, the target "
                         f"{vocab}: a draft model needs the target's tokenizer.")
    logger.info("Speculative decoding: draft model %s (%s, %d layers), %d tokens per proposal",
                source.name, type(draft_hf_config).__name__, draft_hf_config.num_hidden_layers,
                spec.num_speculative_tokens)
    return DraftModelConfig(source.path, source.gguf_file, draft_hf_config, quantization=spec.quantization)


def draft_max_model_len(draft: DraftModelConfig, spec: SpeculativeConfig, max_model_len: int) -> int:
    """How far the draft proposes: its `max_model_len` (speculative_config) or its own
    maximum; sequences longer than that decode one token at a time (as vLLM)."""
    own = int(getattr(draft.hf_config, "max_position_embeddings", 0) or max_model_len)
    if spec.max_model_len is not None and spec.max_model_len > own:
        raise ValueError(f"speculative_config max_model_len={spec.max_model_len} is larger than the draft "
                         f"model's maximum context length ({own}).")
    return min(spec.max_model_len or own, max_model_len)


def size_block_pool(config: EngineConfig, executor: Any, device: torch.device, per_block: int,
                    max_model_len: int) -> tuple[int, MemoryProfile | None]:
    """(blocks in the pool, the GPU profile they were sized by or None). CPU: `kv_cache_space`
    GiB. GPU: what is left of `gpu_memory_utilization` of the device after the weights, a
    profile step of `max_num_batched_tokens` tokens, the CUDA graph pool and non-torch memory
    (worker/memory_sizing.py); errors say what to change."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, None
    if device.type == "cuda":
        tokens = config.resolved_max_num_batched_tokens(max_model_len)
        profile = executor.profile_memory(tokens, min(config.max_num_seqs, tokens), max_model_len)
        # Each rank's device holds only its KV heads of every block: one block costs a rank
        # `kv_share` times fewer bytes than `per_block` (all heads) says.
        rank_block = -(-per_block // executor.kv_share)
        sizing = size_kv_cache(profile, config.gpu_memory_utilization, rank_block, config.block_size, max_model_len)
        logger.info("GPU memory: %s; gpu_memory_utilization=%.2f leaves %.2f GiB for the KV cache: %d blocks",
                    profile.describe(), config.gpu_memory_utilization, sizing.budget_bytes / (1 << 30),
                    sizing.num_blocks)
        return sizing.num_blocks, profile
    budget = int(config.kv_cache_space * (1 << 30))
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"The KV cache budget ({budget} bytes) holds no block of {per_block} bytes; "
                         "raise kv_cache_space.")
    return int(num_blocks), None


def scheduler_config(config: EngineConfig, max_num_batched_tokens: int, max_model_len: int, hf_config: Any,
                     pooling: Any) -> SchedulerConfig:
    """The scheduler's configuration from the engine's (a pooling core's chunking is its own)."""
    return SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=config.enable_chunked_prefill if pooling is None else pooling.chunked_prefill,
        preemption_mode=config.preemption_mode,
        policy=config.scheduling_policy,
        long_context_after=long_context_threshold(hf_config, max_model_len),
        max_loras=config.max_loras if config.enable_lora else 0,
        max_num_encoder_input_tokens=config.max_num_encoder_input_tokens,
        encoder_cache_size=config.encoder_cache_size,
    )


def compile_batch_sizes(config: EngineConfig, device: torch.device) -> list[int] | None:
    """The torch.compile'd decode graphs' batch sizes (CPU; a GPU captures CUDA graphs instead:
    executor/cuda_graph_sizes); None (eager only) unless asked for, or with enforce_eager."""
    if config.enforce_eager or device.type != "cpu" or not config.compile_batch_sizes:
        return None
    return sorted(set(config.compile_batch_sizes))


def log_cache_size(config: EngineConfig, groups: KVCacheGroups | None, kv_cache_dtype: torch.dtype,
                   per_block: int, num_blocks: int, num_host_blocks: int, max_model_len: int) -> None:
    block_size = config.block_size
    tokens = num_blocks * block_size
    concurrency = tokens / max_model_len
    if groups is not None:  # what one full-length sequence holds over its groups
        chunk = config.resolved_max_num_batched_tokens(max_model_len)
        peak = groups.peak_blocks(max_model_len, block_size, chunk)
        concurrency = (num_blocks - 1) / peak
        logger.info("KV cache groups: %d, of %d layer(s) each (%s); a block holds %d layer(s); "
                    "a %d-token sequence holds at most %d blocks in a step of %d tokens",
                    len(groups.groups), groups.slots,
                    ", ".join("full" if g.sliding_window is None else f"window {g.sliding_window}"
                              for g in groups.groups), groups.slots, max_model_len, peak, chunk)
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB of %s; maximum concurrency for "
        "%d tokens per request: %.2fx; swap space: %d blocks",
        num_blocks, block_size, tokens, num_blocks * per_block / (1 << 30),
        str(kv_cache_dtype).removeprefix("torch."), max_model_len, concurrency, num_host_blocks,
    )


def eos_token_ids(hf_config: Any, model: Any, source: ModelSource, load_tokenizer: Callable[[], Any],
                  generates: bool = True) -> set[int]:
    """The model's EOS ids: its config's, its generation config's (the model's and the folder's
    generation_config.json), else the tokenizer's (a GGUF file names it in its metadata). None
    for a pooling model (`generates` False): it never samples a token."""
    ids: set[int] = set()
    if not generates:
        return ids
    for src in (hf_config, getattr(model, "generation_config", None)):
        value = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    path = None if source.is_gguf else Path(source.path) / "generation_config.json"
    if path is not None and path.exists():
        value = json.loads(path.read_text()).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else (value or []))
    if not ids:
        eos = load_tokenizer().eos_token_id
        if eos is not None:
            ids.add(eos)
    return ids

"""Decoder embedding models through the paged engine: the torch-free scheduler and KV cache
manager of generation (continuous batching, token budget, chunked prefill, prefix caching)
and the model runner's paged forward, prefill only. A request is one sequence; when its
prefill reaches the last prompt token it is pooled and finished, its blocks freed (and its
full blocks left in the prefix cache, so a shared prefix is served from there)."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_config import SchedulerConfig
from pagedllm.engine.step_planner import plan_of
from pagedllm.pooling.poolers import pool
from pagedllm.pooling.work import PoolingWork


def decoder_num_blocks(config: Any, hf_config: Any, dtype: torch.dtype) -> int:
    """KV blocks of the pool: `num_kv_blocks`, else what `kv_cache_space` GiB hold."""
    if config.num_kv_blocks:
        return int(config.num_kv_blocks)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    per_block = (2 * hf_config.num_hidden_layers * config.block_size * kv_heads * head_dim
                 * torch.finfo(dtype).bits // 8)
    return max(1, int(config.kv_cache_space * (1 << 30)) // per_block)


class DecoderPoolingRunner:
    """add / step / abort; `step()` returns (request id, pooled hidden state) for the
    requests whose prefill finished this step."""

    def __init__(self, config: Any, source: Any, hf_config: Any, arch: str, dtype: torch.dtype,
                 device: torch.device, max_model_len: int, pooling_type: str, num_blocks: int) -> None:
        from pagedllm.model.loader import load_model
        from pagedllm.worker.model_runner import ModelRunner

        cfg = copy.copy(hf_config)
        cfg.architectures = [arch]
        self.model = load_model(source.path, source.gguf_file, cfg, dtype, device,
                                quantization=config.quantization, quant_compute=config.quant_compute)
        self.hidden_size = int(hf_config.hidden_size)
        self.pooling_type = pooling_type
        block_size = config.block_size
        # Prefix caching serves a last-token embedding only: mean / [CLS] pooling need every
        # row, and a cached block has none.
        self.use_prefix_cache = config.enable_prefix_caching and pooling_type == "LAST"
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_caching=self.use_prefix_cache)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.resolved_max_num_batched_tokens(max_model_len),
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
        ), self.kv_cache_manager)
        self.runner = ModelRunner(self.model, cfg, num_blocks, block_size, dtype, device, max_model_len=max_model_len)
        self.num_blocks = num_blocks
        self._seq_ids = iter(range(1 << 62))
        self._seqs: dict[str, SequenceState] = {}
        self._rows: dict[int, list[torch.Tensor]] = {}  # mean pooling: rows of earlier chunks

    def add(self, work: PoolingWork) -> None:
        seq = SequenceState(seq_id=next(self._seq_ids), request_id=work.request_id,
                       prompt_token_ids=list(work.token_ids),
                       arrival_time=work.arrival_time or time.time(),
                       skip_prefix_cache=not self.use_prefix_cache)
        self._seqs[work.request_id] = seq
        self.scheduler.add_sequence(seq)

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish_sequence(seq, SequenceStatus.FINISHED_ABORTED)
            self._rows.pop(seq.seq_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def step(self) -> list[tuple[str, torch.Tensor]]:
        sched_out = self.scheduler.schedule()
        hidden = self.runner.execute_hidden(plan_of(sched_out))
        self.scheduler.update_after_step(sched_out)
        done = []
        for item, rows in zip(sched_out.scheduled, hidden):
            seq = item.seq
            if self.pooling_type != "LAST":
                if item.start_pos == 0:  # a first chunk, or a recompute after preemption
                    self._rows[seq.seq_id] = []
                self._rows[seq.seq_id].append(rows.float())
            if not item.sample:
                continue
            if self.pooling_type == "LAST":
                vec = rows[-1].float()
            else:
                vec = pool(torch.cat(self._rows.pop(seq.seq_id)), self.pooling_type)
            self.scheduler.finish_sequence(seq, SequenceStatus.FINISHED_STOPPED)
            del self._seqs[seq.request_id]
            done.append((seq.request_id, vec))
        return done

"""One rank of the model: its weights (a tensor-parallel shard, or the whole model), its
ModelRunner and its share of the KV cache.

The same class serves rank 0, which lives in the engine-core process, and ranks 1..N-1 in their
worker processes (executor/worker_proc.py), so every rank builds its model and runs its steps
through exactly the same code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.core.step_plan import StepPlan
from pagedllm.distributed import cpu_binding, parallel_state
from pagedllm.layers.attention import set_attn_backend
from pagedllm.layers.backends import select_attn_backend
from pagedllm.lora.worker_manager import WorkerLoRAManager
from pagedllm.model.loader import load_model
from pagedllm.worker.draft_runner import DraftModelRunner
from pagedllm.worker.memory_sizing import MemoryProfile
from pagedllm.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger(__name__)


@dataclass
class DraftModelConfig:
    """Speculative decoding's draft model (spec_decode/draft_model.py), loaded beside the target."""

    model_path: str
    gguf_file: str | None
    hf_config: Any
    quantization: str | None = None


@dataclass
class WorkerConfig:
    """Everything a rank needs to build its part of the model (picklable: sent to workers)."""

    model_path: str
    gguf_file: str | None
    hf_config: Any
    dtype: torch.dtype
    device_type: str  # "cpu" or "cuda"
    kv_cache_dtype: torch.dtype
    block_size: int
    seed: int = 0
    quantization: str | None = None
    quant_compute: str = "auto"
    tensor_parallel_size: int = 1
    num_threads: int | None = None  # per rank; None: the rank's share of the cores
    collective_timeout_s: float = 120.0
    attention_backend: str = "auto"
    # GPU: the decode buckets to capture as CUDA graphs (None: eager; worker/cuda_graphs.py)
    cuda_graph_sizes: list[int] | None = None
    # A hybrid KV cache's groups (core/kv_cache_groups.py); None: one table for every layer.
    kv_cache_groups: Any = None
    draft: DraftModelConfig | None = None
    # Multi-LoRA (lora/worker_manager.LoRAWorkerConfig); None: LoRA off.
    lora: Any = None
    # True: never the C decode step (worker/cpu_decode_step.py) nor graphs: every step eager.
    enforce_eager: bool = False


class Worker:
    def __init__(self, config: WorkerConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        # One GPU per rank: rank r's on one machine; a Ray actor sees only its own (index 0).
        self.device = (torch.device(f"cuda:{rank % max(1, torch.cuda.device_count())}")
                       if config.device_type == "cuda" else torch.device(config.device_type))
        # A group of one until `init_distributed` (not the process's group: an engine of one rank
        # may live beside a tensor-parallel one, e.g. a test's reference).
        self.tp = parallel_state.TensorParallelGroup(0, 1, "none")
        self.model: torch.nn.Module | None = None
        self.draft_model: torch.nn.Module | None = None
        self.model_runner: ModelRunner | None = None
        self.attn_backend: type | None = None
        self._previous_binding: cpu_binding.CpuBinding | None = None

    def bind_cpu(self, binding: cpu_binding.CpuBinding) -> None:
        """Pin this process's threads to the rank's cores (CPU ranks of one machine)."""
        self._previous_binding = cpu_binding.apply(binding, self.rank)

    def init_distributed(self, init_method: str) -> None:
        """Join the tensor-parallel group (gloo on CPU, NCCL on CUDA)."""
        world = self.config.tensor_parallel_size
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.tp = parallel_state.init_tensor_parallel(self.rank, world, init_method, backend,
                                                      timeout_s=self.config.collective_timeout_s)

    def load_model(self) -> None:
        c = self.config
        torch.manual_seed(c.seed)
        self.model = load_model(c.model_path, c.gguf_file, c.hf_config, c.dtype, self.device,
                                quantization=c.quantization, quant_compute=c.quant_compute,
                                tp=self.tp if self.tp.world_size > 1 else None)
        self.attn_backend = select_attn_backend(c.attention_backend, self.device, c.kv_cache_dtype)
        set_attn_backend(self.model, self.attn_backend)
        if c.draft is not None:
            d = c.draft
            self.draft_model = load_model(d.model_path, d.gguf_file, d.hf_config, c.dtype, self.device,
                                          quantization=d.quantization, quant_compute=c.quant_compute)
            set_attn_backend(self.draft_model, self.attn_backend)

    @property
    def graph_sizes(self) -> list[int] | None:
        """The buckets to capture: the configured ones on a GPU over a capture-safe backend."""
        sizes = self.config.cuda_graph_sizes
        if not sizes or self.device.type != "cuda":
            return None
        if not getattr(self.attn_backend, "capture_safe", False):
            logger.info("CUDA graphs need the Triton attention backend (%s reads tensors on the host); "
                        "decode steps run eager", getattr(self.attn_backend, "name", self.attn_backend))
            return None
        return sizes

    def initialize_cache(self, num_blocks: int, num_host_blocks: int, max_model_len: int,
                         compile_batch_sizes: list[int] | None = None) -> None:
        """This rank's runner and KV cache: the same `num_blocks` on every rank (decided once,
        on rank 0), each block holding only the rank's KV heads."""
        c = self.config
        self.model_runner = ModelRunner(self.model, c.hf_config, num_blocks, c.block_size, c.dtype, self.device,
                                        max_model_len=max_model_len, compile_batch_sizes=compile_batch_sizes,
                                        kv_cache_dtype=c.kv_cache_dtype, cuda_graph_sizes=self.graph_sizes,
                                        kv_cache_groups=c.kv_cache_groups, cpu_decode_step=not c.enforce_eager)
        self.model_runner.cache_engine.allocate_host_pool(num_host_blocks)
        if c.lora is not None:  # adapter slots on every target layer of this rank's shard
            self.model_runner.lora = WorkerLoRAManager(self.model, c.hf_config, c.lora)
        if self.draft_model is not None:  # its KV in the same block ids (worker/draft_runner.py)
            draft = ModelRunner(self.draft_model, c.draft.hf_config, num_blocks, c.block_size, c.dtype, self.device,
                                max_model_len=max_model_len, kv_cache_dtype=c.kv_cache_dtype)
            draft.cache_engine.allocate_host_pool(num_host_blocks)
            self.model_runner.drafter = DraftModelRunner(draft, self.model_runner.block_tables)
        self.model_runner.capture_cuda_graphs()

    def execute_model(self, plan: StepPlan) -> ModelRunnerOutput | None:
        return self.model_runner.execute_model(plan)

    def profile_memory(self, num_tokens: int, num_seqs: int, max_model_len: int) -> MemoryProfile:
        """GPU: this rank's figures for sizing the KV cache (worker/memory_sizing.py), measured on
        a throwaway runner of one block: the weights (what torch holds now), the activation peak of
        a `num_tokens` step over `num_seqs` sampled sequences, the pool that capturing the largest
        decode bucket takes, and what the device uses outside torch. Every rank runs it (the
        forward's collectives)."""
        c, dev = self.config, self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        sizes = self.graph_sizes
        probe = ModelRunner(self.model, c.hf_config, 1, c.block_size, c.dtype, dev, max_model_len=max_model_len,
                            kv_cache_dtype=c.kv_cache_dtype, cuda_graph_sizes=[max(sizes)] if sizes else None)
        probe.profile_run(num_tokens, num_seqs)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - weights
        graphs = 0
        if probe.cuda_graphs is not None:
            probe.capture_cuda_graphs()
            graphs = probe.cuda_graphs.pool_bytes
        del probe
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(dev))
        return MemoryProfile(total=total, weights=weights, peak_activations=max(0, peak), cuda_graphs=graphs,
                             non_torch=non_torch)

    def close(self) -> None:
        """Leave the group and give the process its cores back (rank 0 is the engine's process)."""
        if self.tp.world_size > 1:
            parallel_state.destroy_tensor_parallel()
        self.tp = parallel_state.TensorParallelGroup(0, 1, "none")
        if self._previous_binding is not None:
            cpu_binding.restore(self._previous_binding)
            self._previous_binding = None

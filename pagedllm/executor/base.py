"""Who runs the model: the executor interface the engine core calls.

The engine core (scheduler, KV cache manager, sampler) talks to one `Executor`: it gets the
model shard of rank 0 to read shapes, sizes the KV pool itself, then calls `initialize_cache`
once and `execute_model` every step. `UniprocExecutor` (executor/uniproc.py) runs the one rank in
process; `MultiprocExecutor` (executor/multiproc.py) adds tensor-parallel worker processes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import nn

from pagedllm.core.step_plan import StepPlan
from pagedllm.worker.memory_sizing import MemoryProfile
from pagedllm.worker.model_runner import ModelRunner, ModelRunnerOutput
from pagedllm.worker.worker import Worker


class Executor(ABC):
    driver: Worker  # rank 0, in the engine-core process
    world_size: int = 1

    @property
    def model(self) -> nn.Module:
        """Rank 0's model (its shard under tensor parallelism)."""
        return self.driver.model

    @property
    def model_runner(self) -> ModelRunner:
        """Rank 0's runner (its KV cache share); set by `initialize_cache`."""
        return self.driver.model_runner

    @property
    def kv_share(self) -> int:
        """How many times fewer bytes a KV block costs one rank than the whole block (each rank
        holds `model.num_kv_heads` of the model's KV heads): 1 without tensor parallelism."""
        cfg = self.driver.config.hf_config
        total = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return total // self.model.num_kv_heads

    @abstractmethod
    def initialize_cache(self, num_blocks: int, num_host_blocks: int, max_model_len: int,
                         compile_batch_sizes: list[int] | None = None) -> None:
        """Every rank's runner with `num_blocks` KV blocks (its own heads) and the host pool."""

    @abstractmethod
    def execute_model(self, plan: StepPlan) -> ModelRunnerOutput:
        """One step on every rank; the logits (rank 0's) come back."""

    @abstractmethod
    def profile_memory(self, num_tokens: int, num_seqs: int, max_model_len: int) -> MemoryProfile:
        """GPU: every rank's memory figures for a `num_tokens` step over `num_seqs` sequences,
        combined rank by rank (`MemoryProfile.worst`; worker/memory_sizing.py)."""

    def shutdown(self) -> None:  # noqa: B027 (nothing to stop in process)
        """Stop the workers (idempotent)."""

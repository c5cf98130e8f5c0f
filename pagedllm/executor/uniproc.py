"""The executor of one rank, in process: no worker, no collective (tensor_parallel_size=1)."""

from __future__ import annotations


from pagedllm.core.step_plan import StepPlan
from pagedllm.executor.base import Executor
from pagedllm.worker.memory_sizing import MemoryProfile
from pagedllm.worker.model_runner import ModelRunnerOutput
from pagedllm.worker.worker import Worker, WorkerConfig


class UniprocExecutor(Executor):
    def __init__(self, config: WorkerConfig) -> None:
        self.driver = Worker(config, rank=0)
        self.driver.load_model()

    def initialize_cache(self, num_blocks, num_host_blocks, max_model_len, compile_batch_sizes=None) -> None:
        self.driver.initialize_cache(num_blocks, num_host_blocks, max_model_len, compile_batch_sizes)

    def execute_model(self, plan: StepPlan) -> ModelRunnerOutput:
        return self.driver.execute_model(plan)

    def profile_memory(self, num_tokens: int, num_seqs: int, max_model_len: int) -> MemoryProfile:
        return self.driver.profile_memory(num_tokens, num_seqs, max_model_len)

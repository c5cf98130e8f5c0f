"""Worker side: the KV cache tensors and the model runner."""

from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.worker.model_runner import ModelInput, ModelRunner, ModelRunnerOutput

__all__ = ["CacheEngine", "ModelInput", "ModelRunner", "ModelRunnerOutput"]

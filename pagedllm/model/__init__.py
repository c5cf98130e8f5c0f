"""Model definitions, the architecture registry and weight loading."""

from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import load_model
from pagedllm.model.registry import get_model_class, supported_architectures

__all__ = ["LlamaForCausalLM", "get_model_class", "load_model", "supported_architectures"]

"""Attention backends: how a layer reads and writes the paged KV cache.

`torch_paged` is the portable implementation (plain torch ops, any device). A GPU backend
(Triton kernels, CUDA graphs) plugs in here with the same `forward` signature.
"""

from __future__ import annotations

from pagedllm.layers.backends.torch_paged import TorchPagedAttentionBackend


def get_attn_backend() -> type[TorchPagedAttentionBackend]:
    return TorchPagedAttentionBackend


__all__ = ["TorchPagedAttentionBackend", "get_attn_backend"]

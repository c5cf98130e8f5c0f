"""The KV cache tensors: per layer a (key, value) pair of `[num_blocks, block_size, kv_heads,
head_dim]`, carved out of one zero-initialised allocation so that block copies touch every layer in
one indexing operation."""

from __future__ import annotations

import torch


class CacheEngine:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        # Zeros, not empty: padded reads of unused slots are masked out, but a NaN in garbage
        # memory would still poison `softmax @ V` (0 * NaN = NaN).
        self._cache = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=self.device
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self._cache[layer, 0], self._cache[layer, 1]) for layer in range(num_layers)
        ]

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """2 (K and V) x layers x block_size x kv_heads x head_dim x bytes per element."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    @property
    def total_bytes(self) -> int:
        return self._cache.numel() * self._cache.element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the contents of block `src` into block `dst` for every `(src, dst)`, all layers,
        K and V (copy-on-write). All sources are read before any destination is written."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)
        self._cache[:, :, dst] = self._cache[:, :, src]

"""The KV cache tensors: per layer one zero-initialised tensor `[2, num_blocks, block_size,
kv_heads, head_dim]` (index 0: keys, 1: values) of the cache's dtype (float32, bfloat16), or
for int8 `[2, num_blocks, block_bytes]` raw blocks that carry their own scales
(layers/kv_cache_dtype.py): the copies and swaps below move whole blocks, scales included.

Why one allocation per layer and not one for all layers: a compiled decode graph takes every
layer's cache as an input that its attention op mutates in place, and inductor can only do that
in place (instead of cloning the cache every step) when the inputs do not alias each other.
Block copies and swaps therefore loop over the layers.

Swap preemption adds a host pool of the same layout (`allocate_host_pool`): pinned CPU memory
on a GPU; on CPU a separate tensor, so that the mechanism runs and is tested without a GPU."""

from __future__ import annotations

import math
import mmap

import torch

from pagedllm.layers import kv_cache_dtype


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
        layer_slots: list[int] | None = None,
    ) -> None:
        """`layer_slots[i]`: the slot tensor layer i reads and writes (a hybrid KV cache,
        core/kv_cache_groups.py: layers of different groups share a tensor, a block belonging
        to one group at a time); None: a tensor per layer."""
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
        # Zero int8 blocks are all-zero scales and codes: value 0, like the float caches.
        shape = kv_cache_dtype.layer_shape(dtype, num_blocks, block_size, num_kv_heads, head_dim)
        if layer_slots is not None and len(layer_slots) != num_layers:
            raise ValueError(f"layer_slots names {len(layer_slots)} layers, the model has {num_layers}")
        slots = layer_slots if layer_slots is not None else list(range(num_layers))
        # The distinct tensors (what copies and swaps move), and each layer's view of them.
        self.slot_caches: list[torch.Tensor] = [
            _zeros_on_huge_pages(shape, dtype, self.device) for _ in range(max(slots) + 1)
        ]
        self.kv_caches: list[torch.Tensor] = [self.slot_caches[i] for i in slots]
        self._host_cache: torch.Tensor | None = None

    def allocate_host_pool(self, num_host_blocks: int) -> None:
        """Host memory for `num_host_blocks` swapped-out blocks.

        `torch.empty`, not zeros: a host block is always written by a swap-out before it is
        read, and untouched pages of a large CPU allocation cost no resident memory.
        """
        if num_host_blocks <= 0:
            self._host_cache = None
            return
        shape = [len(self.slot_caches), *self.slot_caches[0].shape]
        shape[2] = num_host_blocks
        pin = self.device.type == "cuda"
        self._host_cache = torch.empty(shape, dtype=self.dtype, device="cpu", pin_memory=pin)

    @property
    def num_host_blocks(self) -> int:
        return 0 if self._host_cache is None else self._host_cache.shape[2]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device block `src` into host block `dst` for every `(src, dst)`."""
        if not pairs:
            return
        if self._host_cache is None:
            raise RuntimeError("swap_out without a host pool (swap_space is 0)")
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        for slot, cache in enumerate(self.slot_caches):
            self._host_cache[slot][:, dst] = cache[:, src].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host block `src` into device block `dst` for every `(src, dst)`."""
        if not pairs:
            return
        if self._host_cache is None:
            raise RuntimeError("swap_in without a host pool (swap_space is 0)")
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)
        for slot, cache in enumerate(self.slot_caches):
            cache[:, dst] = self._host_cache[slot][:, src].to(self.device)

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """2 (K and V) x layers x (block_size x kv_heads x head_dim x bytes per element + int8's
        scale per KV head, padded to 16 bytes)."""
        return 2 * num_layers * kv_cache_dtype.block_bytes(dtype, block_size, num_kv_heads, head_dim)

    @property
    def total_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.slot_caches)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the contents of block `src` into block `dst` for every `(src, dst)`, all layers,
        K and V (copy-on-write). All sources are read before any destination is written."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)
        for cache in self.slot_caches:
            cache[:, dst] = cache[:, src]  # advanced indexing reads all sources first


_MADV_HUGEPAGE = 14
_PAGE = 4096


def _zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor of `shape`; on CPU a fresh anonymous mapping of its own, advised (Linux) to
    use transparent huge pages, that nothing touches here.

    Why a mapping of its own: the kernel hands anonymous memory out zeroed, page by page, when it
    is first touched. `torch.zeros` wrote every byte at start-up instead: with a 4 GiB cache that
    was 2-7 s of page faults (huge-page faults compact memory on a fragmented machine) before the
    first request, and the whole cache resident whether used or not. Now a block's pages arrive
    when a request first writes it, and RSS is what the requests use. Why huge pages: decode
    attention reads blocks scattered over hundreds of MB; with 4 KB pages nearly every block costs
    TLB misses (measured: 15-20% faster attention on 2 MB pages). Best effort: where madvise is
    missing or refused, the cache is simply on normal pages.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    # frombuffer keeps `region` alive as long as the tensor (and its views) live
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)

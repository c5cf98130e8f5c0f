"""How many KV blocks a GPU holds: `gpu_memory_utilization` of the device, less what the rest needs.

    blocks = (total x utilization - weights - peak activations - CUDA graph pool - non-torch)
             // bytes per block

- *weights*: what torch holds once the model is loaded (before any forward);
- *peak activations*: the high-water mark of a profile forward of `max_num_batched_tokens` dummy
  prefill tokens (the largest step the scheduler can build), over the weights;
- *CUDA graph pool*: what capturing the largest decode bucket holds (measured on a throwaway
  runner before the cache exists: the real graphs read the real cache, so they are captured after);
- *non-torch*: memory the device has in use that torch's allocator does not own (the CUDA
  context, NCCL buffers, the libraries' workspaces).

The figures are measured per rank (worker/worker.py `profile_memory`); under tensor parallelism the
largest of each over the ranks counts (`MemoryProfile.worst`). The arithmetic and its errors live
here, apart from the measurement, so that they are unit-tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryProfile:
    """One device's figures in bytes (picklable: workers send theirs to rank 0)."""

    total: int  # the device's memory
    weights: int
    peak_activations: int
    cuda_graphs: int = 0
    non_torch: int = 0

    @staticmethod
    def worst(profiles: list["MemoryProfile"]) -> "MemoryProfile":
        """The rank-by-rank maximum of every figure but `total`, whose minimum counts."""
        if not profiles:
            raise ValueError("no memory profile to combine")
        values = {f.name: max(getattr(p, f.name) for p in profiles) for f in fields(MemoryProfile)}
        values["total"] = min(p.total for p in profiles)
        return MemoryProfile(**values)

    def describe(self) -> str:
        return (f"total {self.total / GIB:.2f} GiB, weights {self.weights / GIB:.2f} GiB, peak activations "
                f"{self.peak_activations / GIB:.2f} GiB, CUDA graphs {self.cuda_graphs / GIB:.2f} GiB, "
                f"non-torch {self.non_torch / GIB:.2f} GiB")


@dataclass(frozen=True)
class KVCacheSizing:
    num_blocks: int
    budget_bytes: int  # what the KV cache may take on one rank
    bytes_per_block: int  # one block on one rank (its KV heads)


def size_kv_cache(profile: MemoryProfile, utilization: float, bytes_per_block: int, block_size: int,
                  max_model_len: int) -> KVCacheSizing:
    """The number of blocks (module docstring), or a ValueError that says what to change.

    `bytes_per_block`: one block as one rank stores it. Refused: a utilization outside (0, 1];
    weights above the utilized memory; a pool that cannot hold one request of `max_model_len`
    tokens (the error names the largest max_model_len that fits)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}.")
    if bytes_per_block <= 0 or block_size <= 0:
        raise ValueError(f"bytes_per_block ({bytes_per_block}) and block_size ({block_size}) must be positive")
    usable = int(profile.total * utilization)
    if profile.weights >= usable:
        raise ValueError(
            f"The model's weights take {profile.weights / GIB:.2f} GiB, which does not fit in "
            f"gpu_memory_utilization={utilization} of the GPU's {profile.total / GIB:.2f} GiB "
            f"({usable / GIB:.2f} GiB). Raise gpu_memory_utilization, use a quantized checkpoint "
            "(AWQ, GPTQ, ...), or split the model over GPUs with tensor_parallel_size."
        )
    budget = usable - profile.weights - profile.peak_activations - profile.cuda_graphs - profile.non_torch
    num_blocks = max(0, budget) // bytes_per_block
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        fits = num_blocks * block_size
        detail = (f"After the weights and the profiled activations ({profile.describe()}), "
                  f"gpu_memory_utilization={utilization} leaves {max(0, budget) / GIB:.2f} GiB for the KV cache: "
                  f"{num_blocks} blocks of {block_size} tokens ({bytes_per_block} bytes each).")
        if fits >= 1:
            raise ValueError(
                f"The KV cache cannot hold one request of max_model_len={max_model_len} tokens. {detail} "
                f"The largest max_model_len that fits is {fits}: lower max_model_len to at most {fits}, "
                "raise gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs (smaller "
                "activations), use kv_cache_dtype='fp8', or add GPUs with tensor_parallel_size."
            )
        raise ValueError(
            f"No memory is left for the KV cache. {detail} Raise gpu_memory_utilization, lower "
            "max_num_batched_tokens / max_num_seqs, use a quantized checkpoint, or add GPUs with "
            "tensor_parallel_size."
        )
    return KVCacheSizing(int(num_blocks), int(budget), bytes_per_block)

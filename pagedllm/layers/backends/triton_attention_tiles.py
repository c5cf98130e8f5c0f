"""Launch shapes of the Triton attention kernels: tile sizes, warps and split-K counts.

Chosen from shapes, host ints and the device's fixed properties only (SM count, compute
capability, both cached), never from a device value, so that a launch is CUDA-graph safe.
Apart from the kernels and the wrappers because this is the part that is tuned per GPU.
"""

from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.layers.backends.triton_attention_kernels import tl

_DEFAULT_SMS = 16  # off CUDA (the interpreter): a small fixed "device" for the split heuristic
_MIN_SPLIT_TOKENS = 256  # fewer keys per split than this do not pay for the reduce pass
_MAX_SPLITS = 64


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


_SMS: dict[int, int] = {}
_CAPS: dict[int, tuple[int, int]] = {}


def _num_sms(device: torch.device) -> int:
    """The device's SM count (132 on an H200), cached; a fixed default off CUDA."""
    if device.type != "cuda":
        return _DEFAULT_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def default_num_splits(num_seqs: int, num_kv_heads: int, table_width: int, block_size: int,
                       device: torch.device) -> int:
    """Splits per (sequence, KV head) from shapes only (CUDA-graph safe): enough programs for
    about two waves over the SMs, but no split shorter than `_MIN_SPLIT_TOKENS` of the
    block table's capacity, and 1 when the batch alone fills the device."""
    programs = max(1, num_seqs * num_kv_heads)
    want = -(-2 * _num_sms(device) // programs)
    by_len = max(1, (table_width * block_size) // _MIN_SPLIT_TOKENS)
    return max(1, min(want, by_len, _MAX_SPLITS))


def _dot_dtype(q_dtype: torch.dtype):
    """The dots' operand type: the query's (IEEE float32 for float32); in the interpreter float32
    for bfloat16 too (its bfloat16 tl.dot multiplies raw bits; the upcast products are exact)."""
    if q_dtype == torch.float32 or (q_dtype == torch.bfloat16 and envs.TRITON_INTERPRET):
        return tl.float32
    return tl.bfloat16 if q_dtype == torch.bfloat16 else tl.float16


def _capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability, cached; Hopper's (9, 0) off CUDA (the interpreter
    takes the configuration the H200 gets)."""
    if device.type != "cuda":
        return (9, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPS:
        _CAPS[index] = tuple(torch.cuda.get_device_capability(index))
    return _CAPS[index]


def _decode_config(head_dim: int, group: int, q_dtype: torch.dtype) -> dict:
    """Tile sizes of the decode kernel: `BLOCK_N` keys a step (64, or 32 where the tiles are
    wide: float32 or head_dim > 128), 4 warps, 2 stages (the K/V loads of the next step in
    flight while this one computes)."""
    block_d = max(16, _next_pow2(head_dim))
    block_n = 32 if block_d > 128 or q_dtype == torch.float32 else 64
    return dict(BLOCK_G=max(16, _next_pow2(group)), BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4, num_stages=2)


def _prefill_config(max_query_len: int, head_dim: int, group: int, q_dtype: torch.dtype,
                    capability: tuple[int, int]) -> dict:
    """Tile sizes of the prefill kernel: `BLOCK_M` rows (query tokens x group heads) up to 128
    with 8 warps on Hopper (wgmma), 64 rows where registers are tighter (pre-Hopper mma,
    float32, head_dim > 128), fewer for short prompts; `BLOCK_N` 64 keys a step (32 wide)."""
    block_d = max(16, _next_pow2(head_dim))
    wide = block_d > 128 or q_dtype == torch.float32
    cap = 64 if wide or capability < (9, 0) else 128
    block_m = min(cap, max(16, _next_pow2(max(1, max_query_len) * group)))
    block_m = max(block_m, _next_pow2(group))  # at least one query token a tile
    return dict(BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_D=block_d, BLOCK_N=32 if wide else 64,
                num_warps=8 if block_m >= 128 else 4, num_stages=2)

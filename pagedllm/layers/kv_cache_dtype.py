"""KV cache element types (`kv_cache_dtype`, docs/kv_cache.md): a layer cache's storage layout
and bytes per block, and the portable torch write and read of each type. The C attention
kernels read and write the same layout in place (kernels/kv_cache_types.h).

One tensor per layer, whatever the type, so that block copies (copy-on-write), swaps and the
compiled decode graphs handle every type alike:
- float32 / bfloat16 / float16: `[2 (K, V), num_blocks, block_size, kv_heads, head_dim]`;
- fp8 (float8_e4m3fn, float8_e5m2): the same float layout, one byte per element, as vLLM's.
  The scales are not in the blocks: one float32 scale per KV head *per layer* for keys and one
  for values (`k_scale`, `v_scale` [Hk], the `Attention` layer's buffers: 1.0, or the
  checkpoint's calibrated ones), stored = fp8(clamp(x / scale, -fmax, fmax)), read =
  stored * scale. A static scale needs no requantization and no per-block header, and block
  copies and swaps need nothing beyond the bytes (the scale is the same for every block);
  `ScaledBlocks` pairs a half with its scale so the torch paths take it like a float half;
- int8: `[2, num_blocks, block_bytes]` raw bytes, each block a header of one float32 scale per
  KV head (padded to 16 bytes) followed by its int8 codes `[block_size, kv_heads, head_dim]`
  (value = code * scale, symmetric absmax). The scales live *inside* their block: whatever
  moves a block's bytes (copy, swap out and in) moves its scales with it.

Incremental int8 writes: a write that starts at offset 0 of a block starts it afresh (its scale
is the new tokens' absmax / 127); a write at offset k > 0 keeps the scale unless the new tokens'
absmax exceeds it, and then first requantizes the k codes already there to the grown scale
(`round(code * old / new)`), then quantizes the new tokens with it. Why this scheme: decode fills
a block one token at a time and the float values of earlier tokens are gone, so a growing scale
must either requantize or clip; a per-layer static scale needs calibration, a scale per token
costs 4 bytes per head and token. A value is requantized only at its block's "record" tokens
(about 2-3 times in a block of 16 for random data), each adding at most half a code step; a full
block (shared, prefix-cached) is never written again, so its scale is final.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

KV_CACHE_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,  # vLLM's "fp8" is e4m3
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
# The C kernels' element kinds (kernels/kv_cache_types.h: KV_F32, KV_BF16, KV_I8). float16 and
# fp8 are absent on purpose: the kernels decline them and the portable torch path runs.
KERNEL_KIND: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_INV127 = 1.0 / 127.0  # as float32: the C kernels' 1.0f / 127.0f


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's storage dtype for `kv_cache_dtype=name`; "auto" is the model's dtype."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_TORCH_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {['auto', *KV_CACHE_TORCH_DTYPES]}, got {name!r}.")
    return KV_CACHE_TORCH_DTYPES[name]


def header_bytes(dtype: torch.dtype, num_kv_heads: int) -> int:
    """Bytes before a block's values: int8's float32 scale per KV head, padded to 16."""
    return -(-4 * num_kv_heads // 16) * 16 if dtype == torch.int8 else 0


def block_bytes(dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block of one half (keys or values) of one layer, scales included."""
    elem = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.int8 and (block_size * num_kv_heads * head_dim) % 4:
        raise ValueError(f"kv_cache_dtype='int8' needs block_size x kv_heads x head_dim to be a multiple of 4 "
                         f"(its float32 scales follow each block), got {block_size} x {num_kv_heads} x {head_dim}")
    return header_bytes(dtype, num_kv_heads) + block_size * num_kv_heads * head_dim * elem


def layer_shape(dtype: torch.dtype, num_blocks: int, block_size: int, num_kv_heads: int,
                head_dim: int) -> tuple[int, ...]:
    """The shape of one layer's cache tensor (module docstring)."""
    if dtype == torch.int8:
        return (2, num_blocks, block_bytes(dtype, block_size, num_kv_heads, head_dim))
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


class Int8Blocks(NamedTuple):
    """One half (keys or values) of a layer's int8 cache: views into its raw blocks. Has the
    `shape` / `dtype` / `data_ptr` / `is_contiguous` a float cache half has, so the attention
    ops take either."""

    raw: torch.Tensor  # int8 [num_blocks, block_bytes]
    codes: torch.Tensor  # int8 [num_blocks, block_size, kv_heads, head_dim], blocks block_bytes apart
    scales: torch.Tensor  # float32 [num_blocks, kv_heads]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.int8

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def data_ptr(self) -> int:
        return self.raw.data_ptr()

    def is_contiguous(self) -> bool:
        return self.raw.is_contiguous()


class ScaledBlocks(NamedTuple):
    """One half (keys or values) of a layer's fp8 cache with the layer's scale for it: value =
    `data.float() * scale` per KV head. Has a float half's `shape` / `dtype` (the fp8 dtype,
    which no C kernel knows, so they decline it) / `data_ptr` / `is_contiguous`."""

    data: torch.Tensor  # float8 [num_blocks, block_size, kv_heads, head_dim]
    scale: torch.Tensor  # float32 [kv_heads]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def data_ptr(self) -> int:
        return self.data.data_ptr()

    def is_contiguous(self) -> bool:
        return self.data.is_contiguous()


KVHalf = torch.Tensor | Int8Blocks | ScaledBlocks


def int8_blocks(raw: torch.Tensor, num_kv_heads: int, head_dim: int) -> Int8Blocks:
    """Views of one half `raw [num_blocks, block_bytes]` of an int8 layer cache."""
    hdr = header_bytes(torch.int8, num_kv_heads)
    data = raw.shape[1] - hdr
    if data <= 0 or data % (num_kv_heads * head_dim):
        raise ValueError(f"an int8 KV cache of {raw.shape[1]}-byte blocks does not hold {num_kv_heads} KV "
                         f"heads of {head_dim}")
    block_size = data // (num_kv_heads * head_dim)
    codes = raw[:, hdr:].unflatten(1, (block_size, num_kv_heads, head_dim))
    scales = raw[:, : 4 * num_kv_heads].view(torch.float32)
    return Int8Blocks(raw, codes, scales)


def split_kv_cache(
    kv_cache: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[KVHalf, KVHalf]:
    """(keys, values) of one layer's cache: tensors `[num_blocks, block_size, Hk, D]`, the int8
    views, or for fp8 `ScaledBlocks` with the layer's `k_scale` / `v_scale` (float32 [Hk]; a
    ValueError without them). Other types ignore the scales."""
    if kv_cache.dtype == torch.int8:
        return int8_blocks(kv_cache[0], num_kv_heads, head_dim), int8_blocks(kv_cache[1], num_kv_heads, head_dim)
    if kv_cache.dtype in FP8_DTYPES:
        return (ScaledBlocks(kv_cache[0], _checked_scale(k_scale, "k_scale", kv_cache.dtype, num_kv_heads)),
                ScaledBlocks(kv_cache[1], _checked_scale(v_scale, "v_scale", kv_cache.dtype, num_kv_heads)))
    return kv_cache[0], kv_cache[1]


def _checked_scale(scale: torch.Tensor | None, name: str, dtype: torch.dtype, num_kv_heads: int) -> torch.Tensor:
    """An fp8 half's scale as float32 [Hk] (a few integer compares: this runs every layer, every
    step). Without one an fp8 cache cannot be written or read: its bytes mean nothing."""
    if scale is None:
        raise ValueError(f"an fp8 KV cache ({dtype}) needs the layer's {name}: a float32 tensor of one scale "
                         f"per KV head [{num_kv_heads}] (ones when the checkpoint has none; the Attention "
                         f"layer's buffers)")
    if scale.shape != (num_kv_heads,):
        raise ValueError(f"{name} of an fp8 KV cache must have shape [{num_kv_heads}] (one per KV head), "
                         f"got {tuple(scale.shape)}")
    return scale if scale.dtype == torch.float32 else scale.float()


def write_rows(cache: KVHalf, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store `x [T, Hk, D]` at the flat slots `slot_mapping [T]`: converted to the cache's dtype
    (round to nearest even), scaled into fp8, or quantized into int8 blocks (module docstring)."""
    if isinstance(cache, Int8Blocks):
        _quantize_rows(cache, x, slot_mapping)
        return
    if isinstance(cache, ScaledBlocks):
        num_kv_heads, head_dim = cache.shape[-2:]
        codes = fp8_quantize(x, cache.scale, cache.dtype)
        # Through a uint8 view: index_copy_ has no fp8 kernel on CPU (the bytes are the same).
        cache.data.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, codes.view(torch.uint8))
        return
    num_kv_heads, head_dim = cache.shape[-2:]
    cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, x.to(cache.dtype))


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x [..., Hk, D]` -> `dtype` (an fp8 type): `clamp(x / scale, -fmax, fmax)`, rounded to
    nearest even by the cast, as vLLM's. The clamp makes both formats saturate (a plain cast
    turns e5m2 overflow into inf, which would poison the softmax); NaN stays NaN."""
    fmax = torch.finfo(dtype).max
    return (x.float() / scale[:, None]).clamp_(-fmax, fmax).to(dtype)


def _quantize_rows(cache: Int8Blocks, x: torch.Tensor, slots: torch.Tensor) -> None:
    """The torch twin of kernels/kv_cache_types.h `kv_store_rows` (the same numbers)."""
    codes, scales = cache.codes, cache.scales
    block_size, num_kv_heads = codes.shape[1], codes.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    uniq, inverse = torch.unique(blocks, return_inverse=True)
    xf = x.float()
    row_amax = xf.abs().amax(-1)  # [T, Hk]
    amax = torch.zeros(uniq.numel(), num_kv_heads, device=x.device)
    amax.scatter_reduce_(0, inverse[:, None].expand(-1, num_kv_heads), row_amax, "amax")
    first = torch.full((uniq.numel(),), block_size, dtype=torch.long, device=x.device)
    first.scatter_reduce_(0, inverse, offsets, "amin")  # the write's first offset in each block
    old = torch.where((first > 0)[:, None], scales[uniq], 0.0)  # offset 0: the block starts afresh
    new = torch.maximum(old, amax * _INV127)  # float32 x float32(1/127), as the kernels
    # Requantize the codes already there (rows before `first`) where the scale grew; factor 1
    # elsewhere leaves a code as it is. Unconditional: no host sync on a GPU.
    grow = (old > 0) & (new > old)
    ratio = torch.where(grow, old / torch.where(grow, new, 1.0), 1.0)  # [U, Hk]
    kept = torch.arange(block_size, device=x.device)[None, :] < first[:, None]  # [U, B]
    factor = torch.where(kept[:, :, None], ratio[:, None, :], 1.0)  # [U, B, Hk]
    codes[uniq] = torch.round(codes[uniq].float() * factor[..., None]).to(torch.int8)
    scales[uniq] = new
    inv = torch.where(new > 0, 1.0 / torch.where(new > 0, new, 1.0), 0.0)
    q = torch.round(xf * inv[inverse][:, :, None]).clamp_(-127, 127).to(torch.int8)
    codes[blocks, offsets] = q


def gather_blocks(cache: KVHalf, block_table: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The blocks `block_table [..., n]` of a cache half, flattened to `[..., n * block_size,
    Hk, D]`, in `dtype` (default: the cache's; int8 and fp8 are dequantized, to float32 by default).
    One `index_select` (several times faster than `cache[table]`)."""
    flat = block_table.reshape(-1)
    if isinstance(cache, Int8Blocks):
        num_blocks, block_size, num_kv_heads, head_dim = cache.codes.shape
        out_dtype = dtype or torch.float32
        codes = cache.codes.index_select(0, flat).to(out_dtype)
        rows = codes * cache.scales.index_select(0, flat).to(out_dtype)[:, None, :, None]
    elif isinstance(cache, ScaledBlocks):
        num_blocks, block_size, num_kv_heads, head_dim = cache.shape
        codes = torch.index_select(cache.data.view(torch.uint8).view(num_blocks, -1), 0, flat).view(cache.dtype)
        rows = codes.view(-1, block_size, num_kv_heads, head_dim).float() * cache.scale[:, None]  # float32, as vLLM
        if dtype is not None and dtype != torch.float32:
            rows = rows.to(dtype)
    else:
        num_blocks, block_size, num_kv_heads, head_dim = cache.shape
        rows = torch.index_select(cache.view(num_blocks, -1), 0, flat)
        if dtype is not None:
            rows = rows.to(dtype)
    return rows.view(*block_table.shape[:-1], block_table.shape[-1] * block_size, num_kv_heads, head_dim)


def dequantize(cache: KVHalf) -> torch.Tensor:
    """Every block of a cache half as float32 `[num_blocks, block_size, Hk, D]` (tests, tools)."""
    if isinstance(cache, Int8Blocks):
        return cache.codes.float() * cache.scales[:, None, :, None]
    if isinstance(cache, ScaledBlocks):
        return cache.data.float() * cache.scale[:, None]
    return cache.float()

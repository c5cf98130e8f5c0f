"""A GGUF file's matrices in the forms the CPU kernels take: Q4_0 / Q4_1 / Q8_0 layers repacked
for int_gemm.c, and the float values when no kernel can run (with a warning naming the bytes).

Shared by the GGUF linear method (formats/gguf.py) and the embedding table
(layers/linear.VocabEmbedding), so that the layer module need not import the linear method that
builds on it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from gguf import GGMLQuantizationType

from pagedllm.quantization.formats.gguf_block_decoding import gguf_blocks
from pagedllm.quantization.kernels.gguf_kernel import GGUFTensor
from pagedllm.quantization.kernels.int_kernel import PackedIntWeight, kernel_supports, pack_int_weight

logger = logging.getLogger(__name__)
GGUF_BLOCK = 32
INT_GEMM_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # repacked for int_gemm.c when a layer has only these


def is_blocks(t: Any) -> bool:
    return hasattr(t, "codes") and hasattr(t, "offsets")  # gguf_block_decoding.GGUFBlockWeight


def as_gguf_tensor(t: Any) -> GGUFTensor:
    """A float32 / float16 / bfloat16 tensor as a GGUFTensor of its type (GGUFTensors as they are)."""
    if isinstance(t, GGUFTensor):
        return t
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    if t.dim() != 2 or t.dtype not in names:
        raise ValueError(f"a GGUF matrix must be 2-D float32/16, got {tuple(t.shape)} {t.dtype}")
    t = t.contiguous()
    return GGUFTensor(t.view(torch.uint8), names[t.dtype], tuple(t.shape))


def int_gemm_blocks(t: GGUFTensor) -> Any:
    """A Q4_0 / Q4_1 / Q8_0 GGUFTensor unpacked for int_gemm.c's repacking."""
    return gguf_blocks(t.data.numpy(), GGMLQuantizationType[t.type_name], t.shape)


def pack_for_int_gemm(shards: list[Any]) -> PackedIntWeight | None:
    """int_gemm.c's form of a layer whose parts are all Q4_0 / Q4_1 / Q8_0 (None otherwise,
    or without the kernel)."""
    if not all(isinstance(s, GGUFTensor) and s.type_name in INT_GEMM_TYPES for s in shards):
        return None
    blocks = [int_gemm_blocks(s) for s in shards]
    return None if any(b is None for b in blocks) else pack_gguf_blocks(blocks)


def widened(t: Any) -> torch.Tensor:
    """The float values of a GGUFTensor (or a float tensor as it is)."""
    return t.dequantize() if isinstance(t, GGUFTensor) or is_blocks(t) else t


def warn_widened(what: str, parts: list[Any], why: str) -> None:
    packed = [p for p in parts if isinstance(p, GGUFTensor)]
    if packed:
        rows = sum(p.shape[0] for p in parts)
        logger.warning("GGUF %s widened to float32 (%s): %d bytes instead of the file's %d", what, why,
                       rows * parts[0].shape[1] * 4, sum(p.nbytes for p in packed))


def pack_gguf_blocks(shards: list[Any]) -> PackedIntWeight | None:
    """One packed weight for the row-concatenation of `shards` (GGUFBlockWeight), or None when
    the kernel is unavailable."""
    bits = max(s.bits for s in shards)
    k = shards[0].codes.shape[1]
    if not kernel_supports(bits, k, GGUF_BLOCK):
        return None
    codes = torch.cat([s.codes for s in shards])
    d = torch.cat([s.d for s in shards])
    if all(s.offsets.dtype == torch.uint8 for s in shards):
        offsets = torch.cat([s.offsets for s in shards])
    else:  # some shards have minimums: every zero point becomes the minimum it stands for
        offsets = torch.cat([-s.d * s.offsets.float() if s.offsets.dtype == torch.uint8 else s.offsets
                             for s in shards])
    return pack_int_weight(codes, d, offsets, bits, GGUF_BLOCK)

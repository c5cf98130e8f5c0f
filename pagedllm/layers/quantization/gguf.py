"""GGUF files' Q4_0 / Q4_1 / Q8_0 matrices kept packed: the linear method and the embedding form.

The loader (model/gguf_loader.py) hands each such matrix over as its blocks of 32
(`GGUFBlockWeight`: codes, d, zero points or minimums); `GGUFLinearMethod` concatenates the
shards of a fused layer (q/k/v, gate/up) and packs them once for kernels/int_gemm.c, whose exact
path multiplies by the very float32 values llama.cpp's dequantization gives. Shards of different
types are brought to one form without changing a value: 4-bit codes fit 8 bits, and a zero point
z is the minimum -d * z (exact in float32 for a float16 d). Nothing else stays resident: no float32
copy of the weight (about 0.75 bytes a weight for Q4_1 instead of 4). Float tensors (F16 / F32,
K-quants) and machines without the kernel get a float weight and the float path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.layers.quantization.base import LinearMethod, QuantizationConfig, Slices, logical_weight_slices
from pagedllm.layers.quantization.int_kernel import (
    PackedIntWeight,
    int_linear,
    kernel_supports,
    pack_int_weight,
    unpack_int_weight,
    with_choice,
)

GGUF_BLOCK = 32


def _is_blocks(t: Any) -> bool:
    return hasattr(t, "codes") and hasattr(t, "offsets")  # model/gguf_loader.GGUFBlockWeight


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


class GGUFLinearMethod(LinearMethod):
    def __init__(self, prefix: str, compute: str = "exact") -> None:
        self.prefix = prefix
        self.compute = compute

    def create_weights(self, layer, input_size, output_sizes, dtype, device) -> None:
        layer.gguf_shards = {}
        layer.gguf_dtype, layer.gguf_device = dtype or torch.float32, torch.device(device or "cpu")
        layer.int_weight = None
        layer.prepared = None  # the float fallback's kernel form

    def required_weights(self, layer) -> list[str]:
        return ["weight"]

    def load_weight(self, layer, name, tensor, shard_id) -> None:
        if name != "weight":
            raise ValueError(f"GGUF layer {self.prefix}: unexpected tensor {name!r}")
        shard = 0 if shard_id is None else shard_id
        expected = (layer.output_sizes[shard], layer.input_size)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"Shape mismatch loading {self.prefix} shard {shard}: checkpoint has "
                             f"{tuple(tensor.shape)}, model expects {expected}")
        layer.gguf_shards[shard] = tensor

    @torch.no_grad()
    def process_weights_after_loading(self, layer) -> None:
        from pagedllm.layers.linear import prepare_weight

        shards = [layer.gguf_shards[i] for i in range(len(layer.output_sizes))]
        del layer.gguf_shards
        if layer.gguf_device.type == "cpu" and layer.gguf_dtype == torch.float32 and all(map(_is_blocks, shards)):
            packed = pack_gguf_blocks(shards)
            if packed is not None:
                layer.int_weight = with_choice(packed, self.compute)
                return
        w = torch.cat([s.dequantize() if _is_blocks(s) else s.float() for s in shards])
        layer.weight = nn.Parameter(w.to(layer.gguf_dtype).to(layer.gguf_device), requires_grad=False)
        layer.prepared = prepare_weight(layer.weight)  # the float path's kernel form, kept

    def tp_slices(self, layer, name, shard_id, shape=None) -> Slices:
        """Logical `[out, in]` cuts; model/gguf_loader cuts the blocks (a row shard along whole
        blocks of 32 input rows)."""
        return logical_weight_slices(layer, shard_id)

    def weight_bytes(self, layer) -> int:
        if layer.int_weight is not None:
            return layer.int_weight.data.numel()
        return layer.weight.numel() * layer.weight.element_size()

    def dequantized_weight(self, layer) -> torch.Tensor:
        """The float32 `[out, in]` weight (what the exact path multiplies by)."""
        return unpack_int_weight(layer.int_weight) if layer.int_weight is not None else layer.weight.float()

    def apply(self, layer, x, bias) -> torch.Tensor:
        from pagedllm.layers.linear import linear

        packed = layer.int_weight
        if packed is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            lead = x.shape[:-1]
            out = int_linear(x.reshape(-1, x.shape[-1]), packed, self.compute).view(*lead, packed.out_features)
            return out if bias is None else out.add_(bias)
        if packed is not None:  # a non-float32 input: the values, then the float product
            return torch.nn.functional.linear(x, unpack_int_weight(packed).to(x.dtype), bias)
        return linear(x, layer.weight, bias, layer.prepared)


class GGUFConfig(QuantizationConfig):
    """Every projection of a GGUF model gets a GGUFLinearMethod (the file says per tensor
    whether it is blocks or floats; the method takes either)."""

    name = "gguf"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GGUFConfig":
        return cls()

    def get_linear_method(self, prefix, shard_prefixes):
        return GGUFLinearMethod(prefix, self.compute)

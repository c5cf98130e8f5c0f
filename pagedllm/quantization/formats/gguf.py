"""GGUF files' matrices kept packed: the linear method and the embedding form.

The loader (model/gguf_loader.py) hands each matrix over as the file's own bytes
(`GGUFTensor`). A layer whose parts are all Q4_0 / Q4_1 / Q8_0 is repacked once for
kernels/int_gemm.c (its register-tiled kernels, tuned for the default model; 0.75 bytes a
weight for Q4_1 against the file's 0.625), whose exact path multiplies by the very float32
values llama.cpp's dequantization gives; shards of those types are brought to one form without
changing a value (4-bit codes fit 8 bits, a zero point z is the minimum -d * z). Every other
layer (K-quants, Q5_0 / Q5_1, IQ4_NL / IQ4_XS, F16 / BF16, and any mix of types in one fused
layer) keeps its parts as they are in the file and kernels/gguf_gemm.c reads them in place, each
part writing its own output columns. Nothing is widened to float32 unless the kernels cannot run
(no compiler, a GPU, another dtype, rows that are not whole blocks): then a warning names the
layer and the bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.layers.decode_step_parts import gguf_parts, int_weight_parts
from pagedllm.layers.linear import float_step_parts, linear, prepare_weight
from pagedllm.quantization.formats.base import LinearMethod, QuantizationConfig, Slices, logical_weight_slices
from pagedllm.quantization.formats.gguf_packing import (
    as_gguf_tensor,
    is_blocks,
    pack_for_int_gemm,
    pack_gguf_blocks,
    warn_widened,
    widened,
)
from pagedllm.quantization.kernels.gguf_kernel import GGUFTensor, gguf_linear, kernel_takes
from pagedllm.quantization.kernels.int_kernel import int_linear, unpack_int_weight, with_choice


class GGUFLinearMethod(LinearMethod):
    def __init__(self, prefix: str, compute: str = "exact") -> None:
        self.prefix = prefix
        self.compute = compute

    def create_weights(self, layer, input_size, output_sizes, dtype, device) -> None:
        layer.gguf_shards = {}
        layer.gguf_dtype, layer.gguf_device = dtype or torch.float32, torch.device(device or "cpu")
        layer.int_weight = None
        layer.gguf_weights = None
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
        shards = [layer.gguf_shards[i] for i in range(len(layer.output_sizes))]
        del layer.gguf_shards
        layer.gguf_weights = None  # the file's parts, read in place by gguf_gemm.c
        on_cpu = layer.gguf_device.type == "cpu" and layer.gguf_dtype == torch.float32
        if on_cpu and any(isinstance(s, GGUFTensor) for s in shards):
            packed = pack_for_int_gemm(shards)
            if packed is not None:
                layer.int_weight = with_choice(packed, self.compute)
                return
            parts = [as_gguf_tensor(s) for s in shards]
            if all(kernel_takes(p.type_name, p.shape[1]) for p in parts):
                layer.gguf_weights = parts
                return
        if on_cpu and all(map(is_blocks, shards)):  # blocks handed over directly (tests, tools)
            packed = pack_gguf_blocks(shards)
            if packed is not None:
                layer.int_weight = with_choice(packed, self.compute)
                return
        warn_widened(f"layer {self.prefix}", shards,
                     "no kernel for it here" if on_cpu else f"{layer.gguf_dtype} on {layer.gguf_device}")
        w = torch.cat([widened(s).float() for s in shards])
        layer.weight = nn.Parameter(w.to(layer.gguf_dtype).to(layer.gguf_device), requires_grad=False)
        layer.prepared = prepare_weight(layer.weight)  # the float path's kernel form, kept

    def tp_slices(self, layer, name, shard_id, shape=None) -> Slices:
        """Logical `[out, in]` cuts; model/gguf_loader cuts the blocks (a row shard along whole
        blocks of 32 input rows)."""
        return logical_weight_slices(layer, shard_id)

    def weight_bytes(self, layer) -> int:
        if layer.int_weight is not None:
            return layer.int_weight.data.numel()
        if layer.gguf_weights is not None:
            return sum(p.nbytes for p in layer.gguf_weights)
        return layer.weight.numel() * layer.weight.element_size()

    def dequantized_weight(self, layer) -> torch.Tensor:
        """The float32 `[out, in]` weight (what the exact path multiplies by)."""
        if layer.int_weight is not None:
            return unpack_int_weight(layer.int_weight)
        if layer.gguf_weights is not None:
            return torch.cat([p.dequantize() for p in layer.gguf_weights])
        return layer.weight.float()

    def decode_step_parts(self, layer, bucket: int) -> list | None:
        if layer.int_weight is not None:
            return int_weight_parts(layer.int_weight, self.compute, bucket)
        if layer.gguf_weights is not None:
            return gguf_parts(layer.gguf_weights, self.compute)
        return float_step_parts(layer.weight, layer.prepared, bucket)

    def apply(self, layer, x, bias) -> torch.Tensor:
        packed, parts = layer.int_weight, layer.gguf_weights
        if (packed is not None or parts is not None) and x.dtype == torch.float32 and x.device.type == "cpu":
            lead, flat = x.shape[:-1], x.reshape(-1, x.shape[-1])
            out = int_linear(flat, packed, self.compute) if packed is not None else gguf_linear(flat, parts, self.compute)
            out = out.view(*lead, out.shape[-1])
            return out if bias is None else out.add_(bias)
        if packed is not None or parts is not None:  # a non-float32 input: the values, then the float product
            return torch.nn.functional.linear(x, self.dequantized_weight(layer).to(x.dtype), bias)
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

"""AWQ checkpoints (AutoAWQ "gemm" layout), 4 bits.

Per linear layer `W [out, in]`: `qweight` int32 `[in, out / 8]` and `qzeros` int32
`[groups, out / 8]`, both packed along the output dimension in AutoAWQ's interleaved nibble
order (packing.AWQ_ORDER), `scales` float16 `[groups, out]`, groups of `group_size` consecutive
input rows; the zeros are true (asymmetric) zero points. At load the codes are repacked along
the input dimension (the canonical form of packing.py); `modules_to_not_convert` (substrings
of module names, as AutoAWQ matches them) stay float layers.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.quantization.formats.base import (
    PackedIntLinearMethod,
    QuantizationConfig,
    TensorSpec,
    config_int,
)
from pagedllm.quantization.formats.packing import pack_int32, unpack_awq


class AWQLinearMethod(PackedIntLinearMethod):
    format_name = "AWQ"

    def checkpoint_specs(self, input_size, output_sizes):
        if input_size % 8:
            raise self._fail(f"input size {input_size} is not a multiple of 8")
        out, groups = sum(output_sizes), self.num_groups(input_size)
        return [
            TensorSpec("qweight", (input_size, out // 8), (torch.int32,), shard_dim=1, shard_div=8, input_dim=0),
            TensorSpec("qzeros", (groups, out // 8), (torch.int32,), shard_dim=1, shard_div=8, group_dim=0),
            TensorSpec("scales", (groups, out), (torch.float16, torch.bfloat16, torch.float32), shard_dim=1,
                       group_dim=0),
        ]

    def to_canonical(self, layer, tensors):
        codes = unpack_awq(tensors["qweight"])  # [in, out]
        return pack_int32(codes, 4, dim=0), tensors["scales"], unpack_awq(tensors["qzeros"]), None


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, bits: int, group_size: int, modules_to_not_convert: list[str]) -> None:
        if bits != 4:
            raise ValueError(f"AWQ with bits={bits} is not supported (4)")
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"AWQ group_size must be -1 or positive, got {group_size}")
        self.bits, self.group_size, self.modules_to_not_convert = bits, group_size, modules_to_not_convert

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AWQConfig":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (only AutoAWQ's 'gemm' layout)")
        if config.get("zero_point", True) is False:
            raise ValueError("AWQ with zero_point=false is not supported (AutoAWQ's gemm layout has zeros)")
        return cls(int(config_int(config, "bits", "w_bit", default=4)),
                   int(config_int(config, "group_size", "q_group_size", default=128)),
                   list(config.get("modules_to_not_convert") or []))

    def get_linear_method(self, prefix, shard_prefixes):
        skipped = [any(m in p for m in self.modules_to_not_convert) for p in shard_prefixes]
        if any(skipped) and not all(skipped):
            raise ValueError(f"AWQ modules_to_not_convert skips only some of the fused modules {shard_prefixes}")
        if all(skipped):
            return None
        return AWQLinearMethod(prefix, self.bits, self.group_size, self.compute)

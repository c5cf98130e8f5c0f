"""GPTQ checkpoints (AutoGPTQ / GPTQModel layout), 4 and 8 bits.

Per linear layer `W [out, in]` the checkpoint holds, with `pf = 32 // bits`:
- `qweight` int32 `[in / pf, out]`: codes packed sequentially along the input dimension;
- `qzeros` int32 `[groups, out / pf]`: zero points packed sequentially along the output dim;
- `scales` float16 `[groups, out]`;
- `g_idx` int32 `[in]`: the group of each input row (act-order / `desc_act`: not monotonic).
`W[:, r] = (code[r] - zero[g_idx[r]]) * scale[g_idx[r]]`. `checkpoint_format: gptq` (v1, the
default) stores `zero - 1` (the zero is the stored value + 1, as the exllama / Marlin kernels
read it); `gptq_v2` stores the zero itself. `sym` only changes the values (zero 2**(bits-1)),
not the layout. Act-order is undone at load: the input rows are sorted by group (a stable sort,
so each group's rows become consecutive), the codes repacked in that order and the layer keeps
the permutation; the forward reads `x[:, perm]` (one gather of the activations).
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
from pagedllm.quantization.formats.packing import pack_int32, unpack_int32

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT_DTYPES = (torch.int32,)


def act_order_permutation(g_idx: torch.Tensor, group_size: int, prefix: str,
                          what: str = "g_idx") -> torch.Tensor | None:
    """The row order that makes the groups of `g_idx` consecutive (None: already in order).
    Every group must hold exactly `group_size` rows, as GPTQ writes them."""
    rows = g_idx.numel()
    expected = torch.arange(rows, dtype=torch.int64, device=g_idx.device) // group_size
    g = g_idx.to(torch.int64)
    if torch.equal(g, expected):
        return None
    groups = rows // group_size
    if int(g.min()) < 0 or int(g.max()) >= groups:
        raise ValueError(f"layer {prefix}: {what} has group ids outside 0..{groups - 1}")
    perm = torch.sort(g, stable=True).indices
    if not torch.equal(g[perm], expected):
        raise ValueError(f"layer {prefix}: {what} does not put exactly {group_size} input rows in each group")
    return perm


class GPTQLinearMethod(PackedIntLinearMethod):
    format_name = "GPTQ"

    def __init__(self, prefix: str, config: "GPTQConfig") -> None:
        super().__init__(prefix, config.bits, config.group_size, config.compute)
        self.config = config

    def checkpoint_specs(self, input_size, output_sizes):
        pf = 32 // self.bits
        packed_in = self.packed_input_size(input_size)
        out, groups = sum(output_sizes), self.num_groups(input_size)
        return [
            TensorSpec("qweight", (packed_in, out), _INT_DTYPES, shard_dim=1, input_dim=0, input_div=pf),
            TensorSpec("qzeros", (groups, out // pf), _INT_DTYPES, shard_dim=1, shard_div=pf, group_dim=0),
            TensorSpec("scales", (groups, out), _FLOAT_DTYPES, shard_dim=1, group_dim=0),
            TensorSpec("g_idx", (input_size,), (torch.int32, torch.int64), shard_dim=None,
                       required=False, input_dim=0, is_g_idx=True),
        ]

    @property
    def act_order(self) -> bool:
        return self.config.desc_act

    def to_canonical(self, layer, tensors):
        zeros = unpack_int32(tensors["qzeros"], self.bits, dim=1)
        if not self.config.v2:
            zeros = zeros + 1  # v1: stored zero = zero - 1
        qweight, perm = tensors["qweight"], None
        g_idx = tensors["g_idx"]
        gs = layer.input_size if self.group_size == -1 else self.group_size
        if g_idx is None:
            if self.config.desc_act:
                raise self._fail("desc_act is set but the checkpoint has no g_idx")
        else:
            perm = act_order_permutation(g_idx, gs, self.prefix)
            if perm is not None:
                codes = unpack_int32(qweight, self.bits, dim=0)
                qweight = pack_int32(codes.index_select(0, perm), self.bits, dim=0)
        return qweight, tensors["scales"], zeros, perm


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, v2: bool) -> None:
        if bits not in (4, 8):
            raise ValueError(f"GPTQ with bits={bits} is not supported (4 or 8)")
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"GPTQ group_size must be -1 or positive, got {group_size}")
        self.bits, self.group_size, self.desc_act, self.sym, self.v2 = bits, group_size, desc_act, sym, v2

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GPTQConfig":
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported ('gptq' or 'gptq_v2')")
        if config.get("lm_head"):
            raise ValueError("GPTQ with a quantized lm_head is not supported yet")
        if config.get("dynamic"):
            raise ValueError("GPTQ per-module overrides ('dynamic') are not supported yet")
        return cls(int(config_int(config, "bits", "w_bit")), int(config_int(config, "group_size", default=-1)),
                   bool(config.get("desc_act", False)), bool(config.get("sym", True)), fmt == "gptq_v2")

    def get_linear_method(self, prefix, shard_prefixes):
        return GPTQLinearMethod(prefix, self)

"""compressed-tensors checkpoints (llm-compressor), `format: pack-quantized`, W4A16 / W8A16.

Per linear layer `W [out, in]`, with `pf = 32 // num_bits` and signed codes `q` in
`[-2**(b-1), 2**(b-1))` stored as `q + 2**(b-1)`:
- `weight_packed` int32 `[out, in / pf]`: packed sequentially along the input dimension;
- `weight_scale` `[out, groups]` (groups = 1 for the `channel` strategy);
- `weight_zero_point` (asymmetric only): int32 `[out / pf, groups]` packed along the output
  dimension (older writers: int8 `[out, groups]`, signed);
- `weight_shape` `[2]` = `(out, in)`; `weight_g_idx` `[in]` with `actorder: group`.
`W = (q - zero_point) * scale`. Which layers are quantized is the config's business:
`config_groups.*.targets` (a class name such as `Linear`, a module name, or `re:<regex>`) minus
`ignore` (same syntax).

`format: int-quantized` W8A8 (int8 weights per channel, symmetric, and dynamic int8 activations):
`weight` int8 `[out, in]` and `weight_scale` `[out, 1]`; `W = weight * scale`. Such layers always
run the int8 path (the checkpoint asks for int8 activations); pagedllm quantizes activations per
block of 32 inputs, which is finer than the per-token scales the scheme names (never coarser).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from pagedllm.quantization.formats.base import PackedIntLinearMethod, QuantizationConfig, TensorSpec
from pagedllm.quantization.formats.gptq import act_order_permutation
from pagedllm.quantization.formats.packing import pack_int32, unpack_int32

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class CompressedTensorsWNA16Method(PackedIntLinearMethod):
    format_name = "compressed-tensors"

    def __init__(self, prefix: str, bits: int, group_size: int, symmetric: bool, compute: str = "exact",
                 actorder: bool = False) -> None:
        super().__init__(prefix, bits, group_size, compute)
        self.symmetric = symmetric
        self.actorder = actorder  # `actorder: group`: a weight_g_idx scatters the groups

    @property
    def act_order(self) -> bool:
        return self.actorder

    def checkpoint_specs(self, input_size, output_sizes):
        pf = 32 // self.bits
        packed_in = self.packed_input_size(input_size)
        out, groups = sum(output_sizes), self.num_groups(input_size)
        return [
            TensorSpec("weight_packed", (out, packed_in), (torch.int32,), shard_dim=0, input_dim=1, input_div=pf),
            TensorSpec("weight_scale", (out, groups), _FLOAT_DTYPES, shard_dim=0, group_dim=1),
            TensorSpec("weight_zero_point", (out // pf, groups), (torch.int32,), shard_dim=0, shard_div=pf,
                       required=not self.symmetric, group_dim=1),
            TensorSpec("weight_shape", (len(output_sizes), 2), (torch.int64,), shard_dim=0),
            TensorSpec("weight_g_idx", (input_size,), (torch.int32, torch.int64), shard_dim=None, required=False,
                       input_dim=0, is_g_idx=True),
        ]

    def normalize_tensor(self, layer, spec, tensor, shard_id):
        if spec.name == "weight_shape":
            # one row per shard: checked against the layer here, kept only until loading ends
            if tensor.numel() != 2:
                raise self._fail(f"weight_shape has shape {tuple(tensor.shape)}, expected (2,)")
            # the checkpoint's whole layer (a tensor-parallel rank holds a part of it)
            out = layer.full_output_sizes[0 if shard_id is None else shard_id]
            if tensor.tolist() != [out, layer.full_input_size]:
                raise self._fail(f"weight_shape is {tensor.tolist()}, the layer is [{out}, {layer.full_input_size}]")
            return tensor.to(torch.int64).view(1, 2)
        if spec.name == "weight_zero_point":
            if tensor.dtype == torch.int8:  # older writers: unpacked, signed
                return pack_int32(tensor.to(torch.int32) + (1 << (self.bits - 1)), self.bits, dim=0)
        return tensor

    def _shard_range(self, layer, spec, shard_id):
        if spec.name == "weight_shape":
            return (0 if shard_id is None else shard_id), 1
        return super()._shard_range(layer, spec, shard_id)

    def tp_slices(self, layer, name, shard_id, shape=None):
        if name == "weight_shape":
            return []
        cuts = super().tp_slices(layer, name, shard_id, shape)
        pf = 32 // self.bits
        if name == "weight_zero_point" and cuts and cuts[0][0] == 0 and shape is not None \
                and shape[0] == layer.full_output_sizes[shard_id or 0]:  # older writers: unpacked [out, groups]
            cuts = [(0, cuts[0][1] * pf, cuts[0][2] * pf)]
        return cuts

    def to_canonical(self, layer, tensors):
        codes = unpack_int32(tensors["weight_packed"], self.bits, dim=1).t()  # [in, out], unsigned
        scales = tensors["weight_scale"].t()
        offset = 1 << (self.bits - 1)
        if self.symmetric:
            zeros = torch.full(scales.shape, offset, dtype=torch.uint8, device=scales.device)
            stored = tensors["weight_zero_point"]  # some writers store zeros for symmetric schemes
            if stored is not None and not bool((unpack_int32(stored, self.bits, dim=0) == offset).all()):
                raise self._fail("weight_zero_point is not zero for a symmetric scheme")
        else:
            zeros = unpack_int32(tensors["weight_zero_point"], self.bits, dim=0).t()  # already + offset
        perm = None
        if tensors["weight_g_idx"] is not None:
            gs = layer.input_size if self.group_size == -1 else self.group_size
            perm = act_order_permutation(tensors["weight_g_idx"], gs, self.prefix, "weight_g_idx")
            if perm is not None:
                codes = codes.index_select(0, perm)
        return pack_int32(codes, self.bits, dim=0), scales, zeros, perm


class CompressedTensorsW8A8Method(PackedIntLinearMethod):
    format_name = "compressed-tensors W8A8"

    def __init__(self, prefix: str) -> None:
        super().__init__(prefix, 8, -1, "int8")

    def checkpoint_specs(self, input_size, output_sizes):
        out = sum(output_sizes)
        return [TensorSpec("weight", (out, input_size), (torch.int8,), shard_dim=0, input_dim=1),
                TensorSpec("weight_scale", (out, 1), _FLOAT_DTYPES, shard_dim=0, group_dim=1)]

    def to_canonical(self, layer, tensors):
        codes = (tensors["weight"].to(torch.int32) + 128).t()  # [in, out], unsigned, zero 128
        scales = tensors["weight_scale"].t()
        zeros = torch.full(scales.shape, 128, dtype=torch.uint8, device=scales.device)
        return pack_int32(codes, 8, dim=0), scales, zeros, None


def _check_w8a8(gname: str, group: dict[str, Any]) -> None:
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    if not (w.get("type", "int") == "int" and int(w.get("num_bits", 0)) == 8 and w.get("strategy") == "channel"
            and w.get("symmetric", True) and not w.get("dynamic")):
        raise ValueError(f"compressed-tensors config group {gname!r}: int-quantized weights must be int8, "
                         f"symmetric, per channel (got {w})")
    if not (a.get("type", "int") == "int" and int(a.get("num_bits", 0)) == 8 and a.get("dynamic")
            and a.get("symmetric", True) and a.get("strategy") in ("token", "tensor")):
        raise ValueError(f"compressed-tensors config group {gname!r}: int-quantized activations must be dynamic "
                         f"symmetric int8 per token or tensor (got {a}); static activation scales are not supported")


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in ("Linear", name)


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, schemes: list[tuple[list[str], dict[str, Any]]], ignore: list[str]) -> None:
        self.schemes, self.ignore = schemes, ignore

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CompressedTensorsConfig":
        top_format = config.get("format")
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"compressed-tensors quantization_status {status!r}: only 'compressed' checkpoints load")
        schemes = []
        for gname, group in (config.get("config_groups") or {}).items():
            fmt = group.get("format") or top_format
            if fmt == "int-quantized":
                _check_w8a8(gname, group)
                targets = list(group.get("targets") or [])
                if not targets:
                    raise ValueError(f"compressed-tensors config group {gname!r} has no targets")
                schemes.append((targets, dict(group.get("weights") or {}, _w8a8=True)))
                continue
            if fmt != "pack-quantized":
                raise ValueError(f"compressed-tensors config group {gname!r}: format {fmt!r} is not supported yet "
                                 "('pack-quantized' W4A16 / W8A16, 'int-quantized' W8A8)")
            if group.get("input_activations") or group.get("output_activations"):
                raise ValueError(f"compressed-tensors config group {gname!r}: activation quantization (W8A8) "
                                 "is not supported yet")
            w = group.get("weights") or {}
            if w.get("type", "int") != "int" or int(w.get("num_bits", 0)) not in (4, 8):
                raise ValueError(f"compressed-tensors config group {gname!r}: weights {w.get('type')} "
                                 f"{w.get('num_bits')} bits are not supported (int, 4 or 8 bits)")
            strategy = w.get("strategy")
            if strategy not in ("group", "channel"):
                raise ValueError(f"compressed-tensors config group {gname!r}: strategy {strategy!r} is not "
                                 "supported ('group' or 'channel')")
            if w.get("dynamic"):
                raise ValueError(f"compressed-tensors config group {gname!r}: dynamic weight scales are not supported")
            targets = list(group.get("targets") or [])
            if not targets:
                raise ValueError(f"compressed-tensors config group {gname!r} has no targets")
            schemes.append((targets, w))
        if not schemes:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        return cls(schemes, list(config.get("ignore") or []))

    def _scheme_of(self, name: str) -> dict[str, Any] | None:
        if any(_matches(name, t) for t in self.ignore):
            return None
        for targets, weights in self.schemes:
            if any(_matches(name, t) for t in targets):
                return weights
        return None

    def get_linear_method(self, prefix, shard_prefixes):
        found = [self._scheme_of(p) for p in shard_prefixes]
        if any(f != found[0] for f in found):
            raise ValueError(f"compressed-tensors: the fused modules {shard_prefixes} have different schemes")
        w = found[0]
        if w is None:
            return None
        if w.get("_w8a8"):
            return CompressedTensorsW8A8Method(prefix)
        group_size = int(w.get("group_size") or -1) if w["strategy"] == "group" else -1
        if w["strategy"] == "group" and group_size <= 0:
            raise ValueError(f"compressed-tensors: group strategy without a group_size for {prefix}")
        return CompressedTensorsWNA16Method(prefix, int(w["num_bits"]), group_size, bool(w.get("symmetric", True)),
                                            self.compute, actorder=w.get("actorder") == "group")

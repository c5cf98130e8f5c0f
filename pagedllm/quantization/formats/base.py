"""The interfaces of quantized linear layers (vLLM's shape) and the loader they share.

A `QuantizationConfig` is parsed from `config.json`'s `quantization_config` and decides, per
layer, which `LinearMethod` it gets (None: the layer stays a plain float layer). A method owns
its layer's weight tensors:
- `create_weights(layer, input_size, output_sizes, dtype, device)`: the checkpoint's tensors,
  for the whole (possibly fused) layer, in the checkpoint's own layout;
- `load_weight(layer, name, tensor, shard_id)`: one checkpoint tensor (of one shard of a fused
  layer: q/k/v, gate/up are concatenated along the output dimension);
- `process_weights_after_loading(layer)`: once, after loading: the method's compute form;
- `apply(layer, x, bias)`: the forward.

`PackedIntLinearMethod` is the weight-only integer method that GPTQ, AWQ and compressed-tensors
share: they differ in their checkpoint tensors (`checkpoint_specs`) and in how those become the
canonical packed form (`to_canonical`, see packing.py); the forward is the same.

Tensor parallelism: `tp_slices(layer, name, shard_id)` says which `(dim, start, length)` cuts
of a checkpoint tensor a rank reads (the loader cuts before reading). For the packed formats the
specs say where each tensor keeps its output features (`shard_dim`, `shard_div` values per
element) and its input rows (`input_dim`, `input_div`), so a column shard cuts along the
packing of the outputs and a row shard along the packing of the inputs; a cut that would split
a packed int32 word or a quantization group is a ValueError at start-up. A row shard's scales
and zero points (`group_dim`) are read whole (they are small) and cut to its groups after
loading, which also serves act-order checkpoints, whose groups are scattered over the rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from pagedllm.quantization.kernels.int_kernel import (
    PackedIntWeight,
    int_linear,
    kernel_supports,
    pack_int_weight,
    unpack_int_weight,
    with_choice,
)
from pagedllm.layers.decode_step_parts import int_weight_parts
from pagedllm.quantization.formats.packing import dequantize

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

Slices = list[tuple[int, int, int]]  # (dim, start, length) cuts of a checkpoint tensor


def logical_weight_slices(layer: nn.Module, shard_id: int | None) -> Slices:
    """The cut of a `[out, in]` weight for the layer's tensor-parallel shard (float, GGUF)."""
    shard = getattr(layer, "tp_shard", None)
    if shard is None:
        return []
    if shard.kind == "row":
        return [(1, *shard.in_range)]
    return [(0, *shard.out_ranges[shard_id or 0])]


class LinearMethod(ABC):
    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype | None, device: torch.device | str | None) -> None: ...

    @abstractmethod
    def load_weight(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard_id: int | None) -> None: ...

    @abstractmethod
    def required_weights(self, layer: nn.Module) -> list[str]:
        """The checkpoint tensor names (leaf names) each shard of `layer` must provide."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook)
        pass

    def tp_slices(self, layer: nn.Module, name: str, shard_id: int | None,
                  shape: tuple[int, ...] | None = None) -> Slices:
        """The cuts of checkpoint tensor `name` this rank reads (see the module docstring)."""
        if getattr(layer, "tp_shard", None) is None:
            return []
        raise ValueError(f"{type(self).__name__} cannot be split for tensor parallelism")

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def decode_step_parts(self, layer: nn.Module, bucket: int) -> list | None:
        """The C calls `apply` makes for a float32 CPU input in row bucket `bucket`, as
        layers/decode_step_parts.StepPart's for the C decode step; None (the default): this
        method's product is not one of those kernels there, and decode steps run eager."""
        return None


class QuantizationConfig(ABC):
    name: str
    # The arithmetic of the CPU kernel (int_kernel.py): "exact" float32 or "int8" activations;
    # set by get_quantization_config from the engine's `quant_compute`.
    compute: str = "exact"

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> "QuantizationConfig": ...

    @abstractmethod
    def get_linear_method(self, prefix: str, shard_prefixes: list[str]) -> LinearMethod | None:
        """The method of the layer `prefix` (our module name) whose checkpoint modules are
        `shard_prefixes` (q_proj/k_proj/v_proj for a fused qkv_proj), or None (not quantized)."""


def config_int(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` present in `config` (formats spell the same field differently)."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor of a (fused) layer. `shape` is the whole layer's; `shard_dim` is the
    output dimension along which shards are concatenated (None: one tensor for all shards, which
    must agree), `shard_div` how many outputs one element of that dimension covers (packing)."""

    name: str
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    shard_dim: int | None
    shard_div: int = 1
    required: bool = True
    # Tensor parallelism: the dimension of the input rows (None: no input dimension) and how
    # many rows one element covers; the dimension of the quantization groups (scales, zeros);
    # whether this is the row -> group map (g_idx).
    input_dim: int | None = None
    input_div: int = 1
    group_dim: int | None = None
    is_g_idx: bool = False


def dequantize_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The unsigned codes `[in, out]` (uint8) of a canonical `qweight [in / pf, out]`."""
    pf = 32 // bits
    shifts = torch.arange(pf, dtype=torch.int32, device=qweight.device).mul_(bits).view(1, pf, 1)
    codes = (qweight.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(qweight.shape[0] * pf, qweight.shape[1]).to(torch.uint8)


class PackedIntLinearMethod(LinearMethod):
    """Weight-only int4 / int8 with groups: the loader shared by the formats, and the forward.

    On CPU, where kernels/int_gemm.c takes the shape (groups of a multiple of 32), the layer
    keeps only the kernel's packed form (`int_weight`; the checkpoint's and the canonical
    tensors are dropped after loading) and `apply` runs the `compute` path on it: "exact"
    (float32 arithmetic) or "int8" (activations quantized per block of 32). Elsewhere (GPU,
    other group sizes, no compiler) it keeps the canonical form and dequantizes per call
    (the Triton kernel on CUDA, triton_int_gemm.py)."""

    format_name = "packed"

    def __init__(self, prefix: str, bits: int, group_size: int, compute: str = "exact") -> None:
        self.prefix = prefix
        self.bits = bits
        self.group_size = group_size  # -1: one group over the whole input
        self.compute = compute

    # ---- what the formats provide ------------------------------------------------------------
    @abstractmethod
    def checkpoint_specs(self, input_size: int, output_sizes: list[int]) -> list[TensorSpec]: ...

    @abstractmethod
    def to_canonical(self, layer: nn.Module, tensors: dict[str, torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qweight [in/pf, out] int32, scales [groups, out], zeros uint8 [groups, out], perm)."""

    # ---- shared ------------------------------------------------------------------------------
    def _fail(self, msg: str) -> ValueError:
        return ValueError(f"{self.format_name} layer {self.prefix}: {msg}")

    def packed_input_size(self, input_size: int) -> int:
        """Rows of int32 words that hold `input_size` codes packed along the input."""
        pf = 32 // self.bits
        if input_size % pf:
            raise self._fail(f"input size {input_size} is not a multiple of {pf}")
        return input_size // pf

    def num_groups(self, input_size: int) -> int:
        gs = input_size if self.group_size == -1 else self.group_size
        if gs <= 0 or input_size % gs:
            raise self._fail(f"group_size {self.group_size} does not divide the input size {input_size}")
        return input_size // gs

    def create_weights(self, layer, input_size, output_sizes, dtype, device) -> None:
        layer.quant_bits, layer.quant_group_size = self.bits, self.group_size
        shard = getattr(layer, "tp_shard", None)
        if shard is not None and shard.kind == "row" and self.group_size != -1 and not self.act_order:
            start, length = shard.in_range
            if start % self.group_size or length % self.group_size:
                raise self._fail(f"tensor parallelism would split a quantization group: the {shard.full_input} "
                                 f"input rows split into shards of {length}, not a multiple of group_size "
                                 f"{self.group_size}")
        self.num_groups(input_size)  # checks the group size
        specs = self.checkpoint_specs(input_size, list(output_sizes))
        if getattr(layer, "tp_shard", None) is not None:
            specs = self._tp_specs(layer, specs)
        layer.quant_specs = {s.name: s for s in specs}
        layer.quant_loaded = set()  # (name, shard) pairs loaded
        for spec in layer.quant_specs.values():
            layer.register_parameter(spec.name, nn.Parameter(
                torch.empty(spec.shape, dtype=spec.dtypes[0], device=device), requires_grad=False))

    def required_weights(self, layer) -> list[str]:
        return [s.name for s in layer.quant_specs.values() if s.required]

    # ---- tensor parallelism ------------------------------------------------------------------
    def _tp_specs(self, layer, specs: list[TensorSpec]) -> list[TensorSpec]:
        """A shard's specs: a row shard reads its scales / zeros for every group of the whole
        layer (cut to its own after loading); no cut may split an int32 word of packed values."""
        shard = layer.tp_shard
        if shard.kind == "column":
            for start, length in shard.out_ranges:
                for spec in specs:
                    if spec.shard_dim is not None and (start % spec.shard_div or length % spec.shard_div):
                        raise self._fail(f"tensor parallelism would split the {spec.shard_div} outputs packed in "
                                         f"one int32 of {spec.name}: this rank's outputs {start}..{start + length - 1}")
            return specs
        start, length = shard.in_range
        for spec in specs:
            if spec.input_dim is not None and (start % spec.input_div or length % spec.input_div):
                raise self._fail(f"tensor parallelism would split the {spec.input_div} input rows packed in one "
                                 f"int32 of {spec.name}: this rank's rows {start}..{start + length - 1}")
        full_groups = self.num_groups(shard.full_input) if self.group_size != -1 else 1
        out = []
        for spec in specs:
            if spec.group_dim is not None:
                shape = list(spec.shape)
                shape[spec.group_dim] = full_groups
                spec = replace(spec, shape=tuple(shape))
            out.append(spec)
        return out

    @property
    def act_order(self) -> bool:
        """Groups may be scattered over the input rows (a g_idx that is not `row // group_size`)."""
        return False

    def tp_slices(self, layer, name, shard_id, shape=None) -> Slices:
        shard = getattr(layer, "tp_shard", None)
        spec = layer.quant_specs.get(name) if shard is not None else None
        if spec is None:
            return []
        if shard.kind == "column":
            if spec.shard_dim is None:
                return []
            start, length = shard.out_ranges[shard_id or 0]
            return [(spec.shard_dim, start // spec.shard_div, length // spec.shard_div)]
        if spec.input_dim is None:
            return []  # scales / zeros of a row shard: all groups, cut after loading
        start, length = shard.in_range
        return [(spec.input_dim, start // spec.input_div, length // spec.input_div)]

    def _cut_row_shard_groups(self, layer, tensors: dict[str, torch.Tensor | None]) -> None:
        """A row shard's scales / zeros: from every group of the layer to the groups of its own
        rows (in order), and its g_idx renumbered to them; each group must lie wholly on it."""
        if self.group_size == -1:  # one group: its scales are every shard's
            for spec in layer.quant_specs.values():
                if spec.is_g_idx and tensors[spec.name] is not None:
                    tensors[spec.name] = torch.zeros_like(tensors[spec.name])
            return
        start, length = layer.tp_shard.in_range
        g_spec = next((s for s in layer.quant_specs.values() if s.is_g_idx), None)
        g_idx = tensors[g_spec.name] if g_spec is not None else None
        if g_idx is None:
            used = torch.arange(start // self.group_size, (start + length) // self.group_size)
        else:
            used, counts = torch.unique(g_idx.to(torch.int64), return_counts=True)
            if bool((counts != self.group_size).any()):
                raise self._fail(f"tensor parallelism would split a quantization group: rows "
                                 f"{start}..{start + length - 1} hold only part of some act-order groups "
                                 f"(group_size {self.group_size})")
            tensors[g_spec.name] = torch.searchsorted(used, g_idx.to(torch.int64)).to(g_idx.dtype)
        for spec in layer.quant_specs.values():
            if spec.group_dim is not None and tensors[spec.name] is not None:
                tensors[spec.name] = tensors[spec.name].index_select(spec.group_dim, used.to(tensors[spec.name].device))

    def _shard_range(self, layer, spec: TensorSpec, shard_id: int | None) -> tuple[int, int]:
        sizes = layer.output_sizes
        if shard_id is None:
            if len(sizes) != 1:
                raise self._fail(f"{spec.name} must be loaded per shard")
            shard_id = 0
        start, size = sum(sizes[:shard_id]), sizes[shard_id]
        if start % spec.shard_div or size % spec.shard_div:
            raise self._fail(f"{spec.name}: output size {size} is not a multiple of {spec.shard_div} "
                             "(the values packed in one int32)")
        return start // spec.shard_div, size // spec.shard_div

    @torch.no_grad()
    def load_weight(self, layer, name, tensor, shard_id) -> None:
        spec = layer.quant_specs.get(name)
        what = name if shard_id is None else f"{name} (shard {shard_id})"
        if spec is None:
            raise self._fail(f"unexpected checkpoint tensor {name!r} (expected {sorted(layer.quant_specs)})")
        tensor = self.normalize_tensor(layer, spec, tensor, shard_id)
        if tensor.dtype not in spec.dtypes:
            raise self._fail(f"{what} has dtype {tensor.dtype}, expected one of {list(spec.dtypes)}")
        param = getattr(layer, name)
        first = not any(n == name for n, _ in layer.quant_loaded)
        if spec.dtypes[0] in _FLOATS and tensor.dtype != param.dtype:
            if not first:
                raise self._fail(f"{what} has dtype {tensor.dtype}, its other shards {param.dtype}")
            param = nn.Parameter(torch.empty(spec.shape, dtype=tensor.dtype, device=param.device),
                                 requires_grad=False)
            setattr(layer, name, param)  # float tensors keep the checkpoint's dtype (exact)
        if spec.shard_dim is None:
            if tuple(tensor.shape) != tuple(param.shape):
                raise self._fail(f"{what} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            if not first and not torch.equal(param.data, tensor.to(param.device)):
                raise self._fail(f"{what} differs between the shards of a fused layer")
            param.data.copy_(tensor)
        else:
            start, size = self._shard_range(layer, spec, shard_id)
            dst = param.data.narrow(spec.shard_dim, start, size)
            if tuple(tensor.shape) != tuple(dst.shape):
                raise self._fail(f"{what} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
        layer.quant_loaded.add((name, shard_id))

    def normalize_tensor(self, layer, spec: TensorSpec, tensor: torch.Tensor, shard_id: int | None) -> torch.Tensor:
        """Hook for alternative on-disk forms of one tensor (default: as is)."""
        return tensor

    @torch.no_grad()
    def process_weights_after_loading(self, layer) -> None:
        tensors = {}
        for name, spec in layer.quant_specs.items():
            loaded = any(n == name for n, _ in layer.quant_loaded)
            tensors[name] = getattr(layer, name).data if loaded else None
            delattr(layer, name)  # the checkpoint layout does not stay resident
        if getattr(layer, "tp_shard", None) is not None and layer.tp_shard.kind == "row":
            self._cut_row_shard_groups(layer, tensors)
        qweight, scales, zeros, perm = self.to_canonical(layer, tensors)
        groups = self.num_groups(layer.input_size)
        expect = {"qweight": (self.packed_input_size(layer.input_size), layer.output_size),
                  "scales": (groups, layer.output_size), "zeros": (groups, layer.output_size)}
        for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
            assert tuple(t.shape) == expect[name], (name, tuple(t.shape), expect[name])
        layer.register_buffer("perm", None if perm is None else perm.to(torch.int64), persistent=False)
        del layer.quant_specs, layer.quant_loaded
        gs = layer.input_size if self.group_size == -1 else self.group_size
        layer.int_weight = None
        if qweight.device.type == "cpu" and kernel_supports(self.bits, layer.input_size, gs):
            codes = dequantize_codes(qweight, self.bits)  # [in, out]
            layer.int_weight = with_choice(pack_int_weight(codes.T, scales.T.float(), zeros.T.to(torch.uint8),
                                                           self.bits, gs), self.compute)
            return  # the kernel's form is all the layer keeps
        layer.register_buffer("qweight", qweight.contiguous(), persistent=False)
        layer.register_buffer("scales", scales.contiguous(), persistent=False)
        layer.register_buffer("zeros", zeros.to(torch.uint8).contiguous(), persistent=False)

    def dequantized_weight(self, layer) -> torch.Tensor:
        """The float32 `[in, out]` weight (in the canonical, possibly permuted, row order)."""
        if getattr(layer, "int_weight", None) is not None:
            return unpack_int_weight(layer.int_weight).T
        gs = layer.input_size if self.group_size == -1 else self.group_size
        return dequantize(layer.qweight, layer.scales, layer.zeros, self.bits, gs)

    def weight_bytes(self, layer) -> int:
        """Bytes of the weight tensors this layer keeps (for the memory benchmark)."""
        if getattr(layer, "int_weight", None) is not None:
            return layer.int_weight.data.numel()
        return sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales, layer.zeros))

    def decode_step_parts(self, layer, bucket: int) -> list | None:
        packed: PackedIntWeight | None = getattr(layer, "int_weight", None)
        if packed is None or layer.perm is not None:  # a permuted input: one more op than the step runs
            return None
        return int_weight_parts(packed, self.compute, bucket)

    def apply(self, layer, x, bias) -> torch.Tensor:
        if x.is_cuda:  # the Triton dequantize-fused matmul (triton_int_gemm.py), where Triton is installed
            # lazy: imports triton (optional, slow), CUDA only
            from pagedllm.quantization.kernels.triton_int_gemm import apply_packed_int
            if (out := apply_packed_int(self, layer, x, bias)) is not None:
                return out
        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
        packed: PackedIntWeight | None = getattr(layer, "int_weight", None)
        if packed is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            lead = x.shape[:-1]
            out = int_linear(x.reshape(-1, x.shape[-1]), packed, self.compute).view(*lead, packed.out_features)
            return out if bias is None else out.add_(bias)
        w = self.dequantized_weight(layer)
        out = torch.matmul(x, w if x.dtype == torch.float32 else w.to(x.dtype))
        return out if bias is None else out + bias



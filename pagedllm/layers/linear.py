"""Linear layers that know how to load checkpoint weights into themselves.

`Linear` is a plain `y = x W^T (+ b)`. `MergedLinear` fuses several projections that read the same
input (q/k/v, gate/up) into one matrix product; the checkpoint's separate matrices are copied into
row slices of the fused weight at load time.

A layer's weights belong to its *method* (vLLM's shape, quantization/base.LinearMethod):
a quantized checkpoint's method (quantization/), or `FloatLinearMethod` for float weights.
On CPU in float32, `FloatLinearMethod` runs hand-written C kernels against a form of the weight
prepared once after loading (`prepare_weight`) and kept on the layer (`layer.prepared`):
- when the weight is exactly a grid of 4-bit or 8-bit blocks (a float folder exported from a
  GGUF file is; pagedllm/quantization/formats/exact_block_encoding.py checks it bit for bit), kernels/int_gemm.c's exact path
  on that compact form (0.75-1.2 bytes a weight instead of 4; the very same float32 products);
- otherwise kernels/packed_gemm.c on a copy packed into 32-column panels, which beats MKL
  2.6x at 1 row, 2.3x at 20, 1.6x at 64 and 1.1-1.2x at 512-2048 (benchmarks/NOTES.md).
Elsewhere (other dtypes, GPU, under torch.compile, no compiler) `F.linear`.

Per batch size the layer keeps the faster of that kernel and `F.linear` on this machine
(layers/kernel_choice.py: measured once per shape and machine, at preparation).

A prepared form records the weight's data pointer and version counter: if the weight changes in
place after loading, the layer prepares it again on its next call instead of using a stale copy.
Setting `PAGEDLLM_BLOCK_WEIGHTS=0` turns the block form off (for A/B measurements).

Tensor parallelism (docs/tensor_parallel.md): a layer built with a `tp_shard`
(distributed/sharding.LinearShard) holds only its rank's part, in local sizes; `checkpoint_slices`
tells the loader which part of each checkpoint tensor to read (the method knows its tensors'
layouts), so no rank reads a whole matrix. `RowParallelLinear` sums the ranks' partial products
(one all-reduce) before adding its bias; `VocabEmbedding` can hold a range of the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.distributed import parallel_state
from pagedllm.distributed.sharding import LinearShard
from pagedllm.kernels import int_gemm_kernel, packed_gemm_kernel
from pagedllm.layers import kernel_choice
from pagedllm.quantization.formats.exact_block_encoding import FORMAT_Q8S, find_block_encoding
from pagedllm.layers.decode_step_parts import OP_PACKED_F32, StepPart, int_weight_parts
from pagedllm.quantization.formats.base import LinearMethod, Slices, logical_weight_slices
from pagedllm.quantization.formats.gguf_packing import pack_for_int_gemm, pack_gguf_blocks, warn_widened, widened
from pagedllm.quantization.kernels.gguf_kernel import GGUFTensor, gguf_linear, gguf_rows, kernel_takes
from pagedllm.quantization.kernels.int_kernel import (
    PackedIntWeight,
    _int_matmul,
    int_linear,
    int_weight_rows,
    pack_int_weight,
    with_choice,
)

USE_BLOCK_WEIGHTS = envs.PAGEDLLM_BLOCK_WEIGHTS  # read once
_kernel = packed_gemm_kernel
_block_kernel = int_gemm_kernel  # the kernel of the exact block form
_X_CHUNK_ROWS = 144  # packed_gemm.c's M_CHUNK: the scratch holds one chunk of packed activations


class PreparedWeight(NamedTuple):
    key: tuple[int, int, bool]  # (data pointer, version, block form allowed) it was made for
    blocks: PackedIntWeight | None  # the exact block form for int_gemm.c, when the weight has one
    packed: torch.Tensor | None  # float32 panels for packed_gemm.c, when it has none
    paths: "kernel_choice.Choice | tuple[str, ...]" = ("kernel",) * len(kernel_choice.BUCKETS)  # per bucket: kernel / torch


def _key(weight: torch.Tensor) -> tuple[int, int, bool]:
    return (weight.data_ptr(), weight._version, USE_BLOCK_WEIGHTS)


def prepare_weight(weight: torch.Tensor) -> PreparedWeight | None:
    """The kernel-ready form of a 2-D float32 CPU weight, made now (the caller keeps it), or None
    where the C kernels do not apply."""
    kernel = _kernel()
    if kernel is None or weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    key = _key(weight)
    n, k = weight.shape
    source = weight.detach().contiguous()
    block_kernel = _block_kernel() if USE_BLOCK_WEIGHTS else None
    encoding = find_block_encoding(source) if block_kernel is not None else None
    if encoding is not None:
        if encoding.format == FORMAT_Q8S:  # d * q, q int8: unsigned codes q + 128, zero point 128
            codes = (encoding.codes.view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
            offsets = torch.full(encoding.scales.shape, 128, dtype=torch.uint8)
            blocks = pack_int_weight(codes, encoding.scales, offsets, 8, 32)
        else:  # d * q + m, q 0..15
            blocks = pack_int_weight(encoding.codes, encoding.scales, encoding.offsets, 4, 32)
        prepared = PreparedWeight(key, blocks, None)
        form = f"blocks{blocks.bits}-g{blocks.group_size}-{blocks.kind}"
    else:
        packed = torch.empty(kernel.packed_size(n, k), dtype=torch.float32)
        kernel.pack(source.data_ptr(), packed.data_ptr(), n, k)
        prepared = PreparedWeight(key, None, packed)
        form = "f32"
    candidates = {"kernel": lambda x: _kernel_product(x, prepared, n),
                  "torch": lambda x: F.linear(x, source)}
    paths = kernel_choice.choose(f"linear {form} {n}x{k}", candidates, k, default="kernel", out_features=n)
    return prepared._replace(paths=paths)


def current_prepared(weight: torch.Tensor, prepared: PreparedWeight | None) -> PreparedWeight | None:
    """`prepared` if it is still the form of `weight` (not changed in place since), else a new one."""
    if prepared is not None and prepared.key == _key(weight):
        return prepared
    return prepare_weight(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           prepared: PreparedWeight | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for `x [M, K]`, `weight [N, K]`: the C kernels where they apply,
    on `prepared` (the caller's kept form of `weight`; made for this call if missing or stale)."""
    if _kernel_input(x):
        prepared = current_prepared(weight, prepared)
    return linear_prepared(x, weight, bias, prepared)


def _kernel_input(x: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.shape[0] > 0 and x.device.type == "cpu" and x.dtype == torch.float32
            and not torch.compiler.is_compiling())


def linear_prepared(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    prepared: PreparedWeight | None) -> torch.Tensor:
    """`linear` with `prepared` already checked current (a layer that keeps its form, per call)."""
    if _kernel_input(x):
        if prepared is not None:
            m, k = x.shape
            n = weight.shape[0]
            if k != weight.shape[1]:
                raise ValueError(f"linear: the input has {k} in-features, the weight {tuple(weight.shape)} "
                                 f"takes {weight.shape[1]}")
            if bias is not None and bias.shape != (n,):
                raise ValueError(f"linear: bias shape {tuple(bias.shape)} does not match the weight's {n} "
                                 "out-features")
            bucket = kernel_choice.bucket_index(m)
            if prepared.paths[bucket] == "kernel":
                out = _kernel_product(x, prepared, n)
                return out if bias is None else out.add_(bias)
            if isinstance(prepared.paths, kernel_choice.Choice):
                prepared.paths.recheck_if_due(bucket, lambda: F.linear(x, weight, bias),
                                              lambda: _kernel_product(x, prepared, n))
    return F.linear(x, weight, bias)


def _kernel_product(x: torch.Tensor, prepared: PreparedWeight, n: int) -> torch.Tensor:
    """`x @ W^T` by the C kernel of `prepared` (the block form's exact path, or the panels)."""
    if prepared.blocks is not None:
        return _int_matmul(x, prepared.blocks, "exact")  # eager only (_kernel_input)
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    scratch = torch.empty(min(m, _X_CHUNK_ROWS) * k, dtype=torch.float32)
    failed = _kernel().gemm(x.data_ptr(), prepared.packed.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                            m, n, k, torch.get_num_threads())  # fmt: skip
    if failed:
        raise MemoryError("linear: the C GEMM kernel could not allocate its panel buffer")
    return out


def float_step_parts(weight: torch.Tensor, prepared: PreparedWeight | None, bucket: int) -> list[StepPart] | None:
    """The C decode step's view of `linear_prepared` at `bucket` (layers/decode_step_parts.py):
    the kernel of `prepared` where it is current and kept for the bucket, else None."""
    if prepared is None or prepared.key != _key(weight) or prepared.paths[bucket] != "kernel":
        return None
    n, k = weight.shape
    if prepared.blocks is not None:
        return int_weight_parts(prepared.blocks, "exact", bucket)
    return [StepPart(OP_PACKED_F32, prepared.packed, n, k)]


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"Shape mismatch loading {what}: checkpoint has {tuple(src.shape)}, model expects {tuple(dst.shape)}")
    dst.copy_(src)


class FloatLinearMethod(LinearMethod):
    """A float weight `[out, in]` (fused shards as row slices) and the C kernels' form of it,
    prepared once after loading and kept on the layer as `layer.prepared`."""

    def create_weights(self, layer, input_size, output_sizes, dtype, device) -> None:
        layer.weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype, device=device),
                                    requires_grad=False)
        layer.prepared = None

    def required_weights(self, layer) -> list[str]:
        return ["weight"]

    def load_weight(self, layer, name, tensor, shard_id) -> None:
        if name != "weight":
            raise ValueError(f"Checkpoint has a {name} for a layer built without one")
        if shard_id is None:
            _copy_checked(layer.weight.data, tensor, name)
            return
        start, size = sum(layer.output_sizes[:shard_id]), layer.output_sizes[shard_id]
        _copy_checked(layer.weight.data[start : start + size], tensor, f"{name} shard {shard_id}")

    def process_weights_after_loading(self, layer) -> None:
        layer.prepared = prepare_weight(layer.weight)

    def tp_slices(self, layer, name, shard_id, shape=None) -> Slices:
        return logical_weight_slices(layer, shard_id)

    def decode_step_parts(self, layer, bucket: int) -> list[StepPart] | None:
        return float_step_parts(layer.weight, layer.prepared, bucket)

    def apply(self, layer, x, bias) -> torch.Tensor:
        if _kernel_input(x):
            layer.prepared = current_prepared(layer.weight, layer.prepared)  # once, then kept
        return linear_prepared(x, layer.weight, bias, layer.prepared)


class Linear(nn.Module):
    """The layer's tensors belong to its method: `quant_method` (quantization/) for a
    quantized checkpoint (None: float), else a `FloatLinearMethod`; its forward is the method's
    `apply`. The bias stays a float parameter of the layer."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        quant_method: LinearMethod | None = None,
        _output_sizes: Sequence[int] | None = None,
        tp_shard: LinearShard | None = None,
    ) -> None:
        """Sizes are this rank's (local); `tp_shard` says which part of the checkpoint's layer
        they are (None: all of it)."""
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.output_sizes = list(_output_sizes) if _output_sizes is not None else [output_size]
        self.tp_shard = tp_shard
        self.full_input_size = tp_shard.full_input if tp_shard is not None else input_size
        self.full_output_sizes = list(tp_shard.full_outputs) if tp_shard is not None else list(self.output_sizes)
        self.quant_method = quant_method
        self.method: LinearMethod = quant_method if quant_method is not None else FloatLinearMethod()
        self.method.create_weights(self, input_size, self.output_sizes, dtype, device)
        self.lora = None  # its LoRA adapter slots (lora/layers.LoRALinear) when LoRA is enabled
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora.add_to(x, out)

    def required_weights(self) -> list[str]:
        """The checkpoint tensors (leaf names) this layer (each shard of it) must get."""
        return self.method.required_weights(self) + (["bias"] if self.bias is not None else [])

    def checkpoint_slices(self, name: str, shard_id: int | None, shape: tuple[int, ...] | None = None) -> Slices:
        """The `(dim, start, length)` cuts of checkpoint tensor `name` (of fused shard
        `shard_id`, stored with `shape`) that this rank holds; empty: the whole tensor."""
        if self.tp_shard is None:
            return []
        if name == "bias":  # [out]: a column shard's outputs; a row-parallel bias is whole
            if self.tp_shard.kind == "row":
                return []
            start, length = self.tp_shard.out_ranges[shard_id or 0]
            return [(0, start, length)]
        return self.method.tp_slices(self, name, shard_id, shape)

    def process_weights_after_loading(self) -> None:
        """Once, after loading: the method's compute form (the C kernels' form of a float weight,
        a quantized method's packed form)."""
        self.method.process_weights_after_loading(self)

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Load the checkpoint's `bias`, or a tensor of the method (`weight`, `qweight`, ...)."""
        if name != "bias":
            self.method.load_weight(self, name, tensor, None)
            return
        if self.bias is None:
            raise ValueError(f"Checkpoint has a {name} for a layer built without one")
        _copy_checked(self.bias.data, tensor, name)

    def extra_repr(self) -> str:
        quant = "" if self.quant_method is None else f", quant={type(self.quant_method).__name__}"
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}{quant}"


class RowParallelLinear(Linear):
    """A row-parallel layer (o, down): each rank multiplies its slice of the input features by
    its columns of the weight; the partial outputs are summed over the ranks (one all-reduce),
    then the bias (whole on every rank) is added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = parallel_state.all_reduce_sum(self.method.apply(self, x, None))
        if self.lora is not None:
            out = self.lora.add_to(x, out)
        return out if self.bias is None else out.add_(self.bias)


class MergedLinear(Linear):
    """Several output projections of one input in one weight `[sum(output_sizes), input_size]`.

    `forward` returns the concatenated outputs; callers split them with `output_sizes`.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        quant_method: LinearMethod | None = None,
        tp_shard: LinearShard | None = None,
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias=bias, dtype=dtype, device=device,
                         quant_method=quant_method, _output_sizes=output_sizes, tp_shard=tp_shard)
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]

    @torch.no_grad()
    def load_shard(self, shard_id: int, name: str, tensor: torch.Tensor) -> None:
        """Copy one of the separate checkpoint projections into its rows: the method's tensors
        (it concatenates along its output dimension), or the bias."""
        if name != "bias":
            self.method.load_weight(self, name, tensor, shard_id)
            return
        if self.bias is None:
            raise ValueError(f"Checkpoint has a {name} for a layer built without one")
        start, size = self.offsets[shard_id], self.output_sizes[shard_id]
        _copy_checked(self.bias.data[start : start + size], tensor, f"{name} shard {shard_id}")

    def extra_repr(self) -> str:
        return f"in={self.input_size}, outs={self.output_sizes}, bias={self.bias is not None}"


class VocabEmbedding(nn.Module):
    """Token embedding table `[vocab, hidden]`; its weight doubles as a tied LM head.

    A GGUF file's quantized table (Q8_0, Q4_x) stays packed (`load_blocks`): the lookup reads
    rows from the packed form and a tied head multiplies by it, so no float32 table is kept.

    Vocab-parallel (`vocab_range` = this rank's (start, length) of the vocabulary, with
    `parallel`): the table holds only those rows; a lookup gives zeros for the other ids and the
    ranks' lookups are summed (one all-reduce), so every rank gets every token's row."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        vocab_range: tuple[int, int] | None = None,
        parallel: bool = False,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings  # the whole vocabulary
        self.embedding_dim = embedding_dim
        self.vocab_start, self.vocab_rows = vocab_range if vocab_range is not None else (0, num_embeddings)
        self.parallel = parallel
        self.weight = nn.Parameter(
            torch.empty(self.vocab_rows, embedding_dim, dtype=dtype, device=device), requires_grad=False
        )
        self.int_weight = None  # int_kernel.PackedIntWeight, for a Q4_0 / Q4_1 / Q8_0 GGUF table
        self.gguf_weight = None  # gguf_kernel.GGUFTensor, any other GGUF type, read in place

    @torch.no_grad()
    def load_blocks(self, blocks) -> None:
        """Load a GGUF table given as the file's blocks (quantization/gguf_kernel.GGUFTensor,
        or quantization/formats/gguf_block_decoding.GGUFBlockWeight): Q4_0 / Q4_1 / Q8_0 repacked for int_gemm.c, every
        other type kept as it is in the file (gguf_gemm.c); rows are widened on lookup."""
        if tuple(blocks.shape) != tuple(self.weight.shape):
            raise ValueError(f"Shape mismatch loading the embedding: checkpoint has {tuple(blocks.shape)}, "
                             f"model expects {tuple(self.weight.shape)}")
        on_cpu = self.weight.device.type == "cpu" and self.weight.dtype == torch.float32
        if on_cpu and isinstance(blocks, GGUFTensor):
            self.int_weight = pack_for_int_gemm([blocks])
            if self.int_weight is None and kernel_takes(blocks.type_name, blocks.shape[1]):
                self.gguf_weight = blocks
        elif on_cpu:
            self.int_weight = pack_gguf_blocks([blocks])
        if self.int_weight is None and self.gguf_weight is None:  # no kernel, GPU, another dtype
            warn_widened("embedding table", [blocks], "no kernel for it here" if on_cpu else "not float32 on CPU")
            self.weight.data.copy_(widened(blocks))
            return
        del self.weight  # the packed form is the only copy (the paths are chosen once the head's compute is known)
        self.weight = None

    @property
    def packed(self) -> bool:
        """Whether the table is kept in a GGUF file's blocks (no float weight)."""
        return self.int_weight is not None or self.gguf_weight is not None

    def choose_logit_paths(self, compute: str) -> None:
        """Once, by the model after loading (the tied head's compute is known there): the packed
        table's per-batch paths as an LM head (layers/kernel_choice.py)."""
        if self.int_weight is not None:
            self.int_weight = with_choice(self.int_weight, compute)

    def packed_logits(self, hidden: torch.Tensor, compute: str) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1]).float()
        if self.gguf_weight is not None:
            return gguf_linear(flat, [self.gguf_weight], compute)
        return int_linear(flat, self.int_weight, compute)

    def checkpoint_slices(self) -> list[tuple[int, int, int]]:
        """The rows of the checkpoint's table this rank holds (empty: all)."""
        return [(0, self.vocab_start, self.vocab_rows)] if self.parallel else []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel:
            return self._lookup(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_start + self.vocab_rows)
        rows = self._lookup((input_ids - self.vocab_start).masked_fill_(outside, 0))
        rows.masked_fill_(outside.unsqueeze(-1), 0.0)
        return parallel_state.all_reduce_sum(rows)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.int_weight is not None:
            return int_weight_rows(self.int_weight, input_ids)
        if self.gguf_weight is not None:
            return gguf_rows(self.gguf_weight, input_ids)
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        part = f", rows {self.vocab_start}..{self.vocab_start + self.vocab_rows - 1}" if self.parallel else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{part}"

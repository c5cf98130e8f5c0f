"""Linear layers that know how to load checkpoint weights into themselves.

`Linear` is a plain `y = x W^T (+ b)`. `MergedLinear` fuses several projections that read the same
input (q/k/v, gate/up) into one matrix product; the checkpoint's separate matrices are copied into
row slices of the fused weight at load time.

Every projection goes through `linear`: on CPU in float32 it runs the hand-written C kernel
(kernels/packed_gemm.c) against a copy of the weight packed once into 32-column panels, which
beats MKL 2.6x at 1 row, 2.3x at 20, 1.6x at 64 and 1.1-1.2x at 512-2048 (benchmarks/NOTES.md);
otherwise (other dtypes, GPU, under torch.compile, no compiler) `F.linear`.

The packed copy is made on first use and kept on the weight tensor itself, tagged with the
tensor's version counter, so that an in-place change of the weight (loading) repacks it. It
costs as much memory again as the float32 weights it packs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import packed_gemm_kernel

_kernel = packed_gemm_kernel
_PACKED_ATTR = "_pagedllm_packed"
_X_CHUNK_ROWS = 144  # packed_gemm.c's M_CHUNK: the scratch holds one chunk of packed activations


def _packed(weight: torch.Tensor, kernel) -> torch.Tensor:
    """The packed copy of `weight`, made now if it is missing or stale."""
    key = (weight.data_ptr(), weight._version)
    cached = getattr(weight, _PACKED_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    n, k = weight.shape
    source = weight.detach().contiguous()
    packed = torch.empty(kernel.packed_size(n, k), dtype=torch.float32)
    kernel.pack(source.data_ptr(), packed.data_ptr(), n, k)
    setattr(weight, _PACKED_ATTR, (key, packed))
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for `x [M, K]`, `weight [N, K]`: the C kernel where it applies."""
    if (
        x.dim() == 2
        and x.shape[0] > 0
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and not torch.compiler.is_compiling()
    ):
        kernel = _kernel()
        if kernel is not None:
            m, k = x.shape
            n = weight.shape[0]
            x = x.contiguous()
            out = torch.empty(m, n, dtype=torch.float32)
            scratch = torch.empty(min(m, _X_CHUNK_ROWS) * k, dtype=torch.float32)
            kernel.gemm(x.data_ptr(), _packed(weight, kernel).data_ptr(), out.data_ptr(), scratch.data_ptr(), m, n, k,
                        torch.get_num_threads())  # fmt: skip
            return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"Shape mismatch loading {what}: checkpoint has {tuple(src.shape)}, model expects {tuple(dst.shape)}")
    dst.copy_(src)


class Linear(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype, device=device), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Load the checkpoint's `weight` or `bias`."""
        param = self.weight if name == "weight" else self.bias
        if param is None:
            raise ValueError(f"Checkpoint has a {name} for a layer built without one")
        _copy_checked(param.data, tensor, name)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


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
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias=bias, dtype=dtype, device=device)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]

    @torch.no_grad()
    def load_shard(self, shard_id: int, name: str, tensor: torch.Tensor) -> None:
        """Copy one of the separate checkpoint projections (`weight` or `bias`) into its rows."""
        param = self.weight if name == "weight" else self.bias
        if param is None:
            raise ValueError(f"Checkpoint has a {name} for a layer built without one")
        start, size = self.offsets[shard_id], self.output_sizes[shard_id]
        _copy_checked(param.data[start : start + size], tensor, f"{name} shard {shard_id}")

    def extra_repr(self) -> str:
        return f"in={self.input_size}, outs={self.output_sizes}, bias={self.bias is not None}"


class VocabEmbedding(nn.Module):
    """Token embedding table `[vocab, hidden]`; its weight doubles as a tied LM head."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"

"""Linear layers that know how to load checkpoint weights into themselves.

`Linear` is a plain `y = x W^T (+ b)`. `MergedLinear` fuses several projections that read the same
input (q/k/v, gate/up) into one matrix product; the checkpoint's separate matrices are copied into
row slices of the fused weight at load time.

Every projection goes through `linear`: on CPU in float32 with at most `SMALL_GEMM_MAX_ROWS`
rows (decode steps) it runs the hand-written C kernel (kernels/small_gemm.c), which beats MKL
2x to 2.4x at 1 to 4 rows and 1.2x to 1.4x at 20 to 128 (benchmarks/NOTES.md); otherwise (prefill,
other dtypes, GPU, under torch.compile, no compiler) `F.linear`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import small_gemm_kernel

SMALL_GEMM_MAX_ROWS = 128  # measured: ahead of MKL up to 128 rows, behind at 256
_kernel = small_gemm_kernel


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for `x [M, K]`, `weight [N, K]`: the C kernel where it applies."""
    if (
        x.dim() == 2
        and x.shape[0] <= SMALL_GEMM_MAX_ROWS
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.shape[1] % 16 == 0
        and weight.shape[0] % 4 == 0
        and not torch.compiler.is_compiling()
    ):
        kernel = _kernel()
        if kernel is not None and x.shape[0] > 0:
            x = x.contiguous()
            weight = weight.contiguous()
            out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
            kernel(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1],
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

"""A GGUF file's block bytes as torch tensors: the float values (`dequantize_tensor`) and the
Q4_0 / Q4_1 / Q8_0 blocks unpacked for int_gemm.c (`gguf_blocks`).

Here, below both the loader (model/gguf_loader.py) and the kernels' GGUFTensor
(quantization/kernels/gguf_kernel.py), because both read the bytes this way and neither should
import the other for it.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

from gguf import GGMLQuantizationType
from gguf.quants import dequantize
import numpy as np
import torch


def tensor_view(array: np.ndarray) -> torch.Tensor:
    """Zero-copy view of a (possibly read-only, memory-mapped) array; only ever read from."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return torch.from_numpy(np.ascontiguousarray(array))


def dequantize_tensor(data: np.ndarray, tensor_type: Any) -> torch.Tensor:
    """A GGUF tensor's values: float16/bfloat16/float32 as stored (zero-copy where possible), and
    Q4_0, Q4_1, Q8_0 dequantized to float32 in torch (bit-identical to `gguf.quants.dequantize`,
    several times faster); other quantized types through `gguf.quants.dequantize`. The result's
    last dimension is the row; callers reshape."""
    T = GGMLQuantizationType
    if tensor_type in (T.F32, T.F16):
        return tensor_view(data)
    if tensor_type == T.BF16:
        return tensor_view(data.view(np.uint16)).view(torch.bfloat16)
    if tensor_type in (T.Q4_0, T.Q4_1, T.Q8_0):
        raw = tensor_view(data.view(np.uint8))
        rows = raw.shape[0] if raw.dim() > 1 else 1
        if tensor_type == T.Q8_0:  # 32 weights: f16 scale, 32 x int8
            blocks = raw.reshape(-1, 34)
            d = blocks[:, 0:2].contiguous().view(torch.float16).float()
            q = blocks[:, 2:].contiguous().view(torch.int8).float()
            return (q * d).reshape(rows, -1)
        header = 2 if tensor_type == T.Q4_0 else 4  # f16 scale (and f16 minimum for Q4_1)
        blocks = raw.reshape(-1, header + 16)
        d = blocks[:, 0:2].contiguous().view(torch.float16).float()
        qs = blocks[:, header:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # low nibbles: weights 0-15, high: 16-31
        if tensor_type == T.Q4_0:
            return (d * (q.to(torch.int8) - 8).float()).reshape(rows, -1)
        m = blocks[:, 2:4].contiguous().view(torch.float16).float()
        return ((d * q.float()) + m).reshape(rows, -1)
    return torch.from_numpy(np.ascontiguousarray(dequantize(data, tensor_type)))


class GGUFBlockWeight(NamedTuple):
    """A Q4_0 / Q4_1 / Q8_0 matrix kept as its blocks of 32: `W = d * codes + offset` per block,
    with unsigned `codes` (Q8_0's int8 shifted by 128), float32 `d` (float16 values) and either
    uint8 zero points (Q4_0: 8, Q8_0: 128; offset = -d * zero) or float32 minimums (Q4_1)."""

    codes: torch.Tensor  # uint8 [N, K]
    d: torch.Tensor  # float32 [N, K / 32]
    offsets: torch.Tensor  # uint8 zero points or float32 m, [N, K / 32]
    bits: int
    type_name: str

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 values, bit-identical to `dequantize_tensor` of the same tensor."""
        n, k = self.codes.shape
        m = -self.d * self.offsets.float() if self.offsets.dtype == torch.uint8 else self.offsets
        w = self.codes.float().view(n, k // 32, 32) * self.d.unsqueeze(-1) + m.unsqueeze(-1)
        return w.view(n, k)

    def permute_rows(self, fn) -> "GGUFBlockWeight":
        return self._replace(codes=fn(self.codes), d=fn(self.d), offsets=fn(self.offsets))


def gguf_blocks(data: np.ndarray, tensor_type: Any, shape: tuple[int, ...]) -> GGUFBlockWeight | None:
    """The blocks of a 2-D Q4_0 / Q4_1 / Q8_0 tensor of `shape` (rows, row length), unpacked
    for kernels/int_gemm.c's repacking; None for other types and shapes."""
    T = GGMLQuantizationType
    if tensor_type not in (T.Q4_0, T.Q4_1, T.Q8_0) or len(shape) != 2 or shape[1] % 32:
        return None
    n, k = shape
    raw = tensor_view(data.view(np.uint8))
    if tensor_type == T.Q8_0:  # f16 scale, 32 x int8
        blocks = raw.reshape(n, k // 32, 34)
        d = blocks[..., 0:2].contiguous().view(torch.float16).float().view(n, k // 32)
        codes = (blocks[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return GGUFBlockWeight(codes.view(n, k), d, torch.full((n, k // 32), 128, dtype=torch.uint8), 8, "Q8_0")
    header = 2 if tensor_type == T.Q4_0 else 4
    blocks = raw.reshape(n, k // 32, header + 16)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float().view(n, k // 32)
    qs = blocks[..., header:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, k)  # low nibbles: weights 0-15
    if tensor_type == T.Q4_0:
        return GGUFBlockWeight(codes, d, torch.full((n, k // 32), 8, dtype=torch.uint8), 4, "Q4_0")
    m = blocks[..., 2:4].contiguous().view(torch.float16).float().view(n, k // 32)
    return GGUFBlockWeight(codes, d, m, 4, "Q4_1")

"""GGUF Q4_0 / Q4_1 / Q8_0 blocks kept packed: the decoded blocks stand for exactly the values
the float32 loader gives (`dequantize_tensor`, itself bit-identical to gguf.quants), and the
packed form (mixed types in one fused layer included) for exactly those again."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from pagedllm.quantization.formats.gguf_packing import pack_gguf_blocks  # noqa: E402
from pagedllm.quantization.kernels.int_kernel import int_gemm_isa, unpack_int_weight  # noqa: E402
from pagedllm.quantization.formats.gguf_block_decoding import dequantize_tensor, gguf_blocks  # noqa: E402

TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]


def _data(rows: int, cols: int, qtype, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return quantize(w, qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_dequantize_bit_for_bit(qtype):
    data = _data(40, 96, qtype, seed=1)
    blocks = gguf_blocks(data, qtype, (40, 96))
    assert blocks is not None and blocks.shape == (40, 96)
    assert torch.equal(blocks.dequantize(), dequantize_tensor(data, qtype).reshape(40, 96))


def test_other_types_and_shapes_are_not_blocks():
    assert gguf_blocks(np.zeros((4, 8), np.float32), T.F32, (4, 8)) is None
    assert gguf_blocks(_data(1, 64, T.Q8_0, 0), T.Q8_0, (64,)) is None


@pytest.mark.skipif(int_gemm_isa() is None, reason="the int_gemm C kernel cannot be built here")
def test_mixed_shards_pack_to_the_same_values():
    shards = [gguf_blocks(_data(n, 64, t, seed=i), t, (n, 64)) for i, (n, t) in enumerate(zip((32, 16, 16), TYPES))]
    packed = pack_gguf_blocks(shards)
    assert packed.bits == 8  # one shard is Q8_0: all become 8-bit codes, values unchanged
    assert torch.equal(unpack_int_weight(packed), torch.cat([s.dequantize() for s in shards]))
    four = pack_gguf_blocks(shards[:2])  # Q4_0 + Q4_1: 4-bit, zero points become minimums
    assert four.bits == 4 and torch.equal(unpack_int_weight(four), torch.cat([s.dequantize() for s in shards[:2]]))

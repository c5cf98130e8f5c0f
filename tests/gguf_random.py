"""Random but valid GGUF tensors of every type pagedllm reads, for kernel and model tests.

Every bit pattern of a block's codes and packed sub-scales is a valid block, so random bytes
with sane float16 scale fields exercise a type's whole layout (not one quantizer's outputs).
`typical` sets the size of the weights the scales produce (about their mean absolute value).
"""

from __future__ import annotations

import numpy as np

# byte offsets of each type's float16 fields inside a block: (scale d, minimum / dmin or None)
F16_FIELDS = {"Q4_0": (0, None), "Q4_1": (0, 2), "Q5_0": (0, None), "Q5_1": (0, 2), "Q8_0": (0, None),
              "IQ4_NL": (0, None), "Q2_K": (80, 82), "Q3_K": (108, None), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208, None), "IQ4_XS": (0, None)}
# about the mean |sub-scale * code| per unit of d (so that d = typical / this)
_CODE_SIZE = {"Q4_0": 4, "Q4_1": 7.5, "Q5_0": 8, "Q5_1": 15.5, "Q8_0": 64, "IQ4_NL": 55, "Q2_K": 11,
              "Q3_K": 40, "Q4_K": 240, "Q5_K": 500, "Q6_K": 1000, "IQ4_XS": 900}
# mean code per unit of the minimum's scale (asymmetric types: dmin centres the weights)
_MIN_CENTRE = {"Q4_1": 7.5, "Q5_1": 15.5, "Q2_K": 11, "Q4_K": 7.5, "Q5_K": 15.5}
QUANTIZED = list(F16_FIELDS)
ALL_TYPES = QUANTIZED + ["F16", "BF16", "F32"]


def random_tensor(type_name: str, rows: int, cols: int, seed: int = 0, typical: float = 0.01) -> np.ndarray:
    """A valid `[rows, row bytes]` uint8 tensor of `type_name` (float types: their values)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    if type_name == "F32":
        return (rng.standard_normal((rows, cols)) * typical).astype(np.float32)
    if type_name == "F16":
        return (rng.standard_normal((rows, cols)) * typical).astype(np.float16)
    if type_name == "BF16":
        values = (rng.standard_normal((rows, cols)) * typical).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = cols // block
    data = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    d_at, m_at = F16_FIELDS[type_name]
    d = rng.uniform(0.5, 1.5, (rows, blocks)) * typical / _CODE_SIZE[type_name]
    if m_at is None:
        d *= rng.choice([-1, 1], (rows, blocks))
    data[..., d_at:d_at + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
    if m_at is not None:
        # Q4_1 / Q5_1 store the minimum m (w = d q + m); K-quants store dmin (w = ... - dmin * m)
        centre = -d * _MIN_CENTRE[type_name] if type_name in ("Q4_1", "Q5_1") else d
        data[..., m_at:m_at + 2] = centre.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(rows, -1)


def dequantized(type_name: str, data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """gguf-py's float32 values of `random_tensor`'s output."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if type_name == "BF16":
        return (data.astype(np.uint32) << 16).view(np.float32).reshape(rows, cols)
    return np.ascontiguousarray(dequantize(data, GGMLQuantizationType[type_name]), dtype=np.float32).reshape(rows, cols)

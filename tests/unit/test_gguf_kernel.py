"""kernels/gguf_gemm.c: every GGUF type read in place, against gguf-py's own dequantization.

Blocks are random bytes with sane float16 scales (every bit pattern of the codes and packed
sub-scales is a valid block), so each type's whole layout is exercised, not one quantizer's
outputs. Checked: rows widen bit for bit to gguf-py's values; the exact path equals
dequantize-then-matmul up to summation order at 1, few and many rows (both code paths); the int8
path stays within its quantization error; each part of a fused layer writes its own columns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedllm.kernels import build as kernel_build  # noqa: E402
from pagedllm.quantization.kernels.gguf_kernel import (  # noqa: E402
    TYPES,
    GGUFTensor,
    gguf_linear,
    gguf_matmul,
    gguf_rows,
    kernel_takes,
)
from tests.gguf_random import ALL_TYPES, QUANTIZED, dequantized, random_tensor  # noqa: E402

pytestmark = pytest.mark.skipif(kernel_build.gguf_gemm_kernel() is None, reason="gguf_gemm.c cannot be built here")



def reference(type_name: str, data: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(dequantized(type_name, data, rows, cols))


def as_tensor(type_name: str, data: np.ndarray, rows: int, cols: int) -> GGUFTensor:
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1))
    return GGUFTensor(raw, type_name, (rows, cols))


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_rows_widen_bit_for_bit_to_gguf_py(type_name):
    rows, cols = 7, 512
    data = random_tensor(type_name, rows, cols, seed=1)
    w = as_tensor(type_name, data, rows, cols)
    ref = reference(type_name, data, rows, cols)
    assert torch.equal(gguf_rows(w, None), ref)
    ids = torch.tensor([[6, 0], [3, 3]])
    assert torch.equal(gguf_rows(w, ids), ref[ids])
    with pytest.raises(IndexError):
        gguf_rows(w, torch.tensor([7]))


@pytest.mark.parametrize("type_name", ALL_TYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 40, 150])  # one and several chunks of 16, the panel path over two row chunks
def test_exact_path_equals_dequantize_then_matmul(type_name, m):
    rows, cols = 45, 512  # a partial panel of columns
    data = random_tensor(type_name, rows, cols, seed=m)
    w = as_tensor(type_name, data, rows, cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    ref = x.double() @ reference(type_name, data, rows, cols).double().T
    got = gguf_matmul(x, w, "exact")
    assert got.shape == (m, rows)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("type_name", QUANTIZED)
@pytest.mark.parametrize("m", [1, 9])
def test_int8_path_stays_within_its_quantization_error(type_name, m):
    rows, cols = 40, 1024
    data = random_tensor(type_name, rows, cols, seed=3)
    w = as_tensor(type_name, data, rows, cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(5))
    ref = x.double() @ reference(type_name, data, rows, cols).double().T
    got = gguf_matmul(x, w, "int8").double()
    err = (got - ref).norm() / ref.norm()
    assert err < 0.02, f"{type_name}: relative error {err:.4f}"
    assert not torch.equal(got, gguf_matmul(x, w, "exact").double())  # really another path


def test_fused_parts_of_different_types_write_their_own_columns():
    cols = 256
    parts = [("Q4_K", 32), ("Q6_K", 16), ("Q8_0", 16), ("F16", 8)]
    tensors, refs = [], []
    for i, (t, n) in enumerate(parts):
        data = random_tensor(t, n, cols, seed=10 + i)
        tensors.append(as_tensor(t, data, n, cols))
        refs.append(reference(t, data, n, cols))
    x = torch.randn(5, cols)
    got = gguf_linear(x, tensors, "exact")
    ref = x.double() @ torch.cat(refs).double().T
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)


def test_types_and_shapes_it_does_not_take():
    assert set(TYPES) >= set(ALL_TYPES)
    assert not kernel_takes("Q4_K", 96)  # not whole blocks of 256
    assert kernel_takes("Q4_K", 512) and kernel_takes("Q8_0", 96)
    assert not kernel_takes("IQ2_XXS", 256)
    w = as_tensor("Q8_0", random_tensor("Q8_0", 4, 64), 4, 64)
    with pytest.raises(ValueError, match="in-features"):
        gguf_matmul(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="compute"):
        gguf_matmul(torch.randn(2, 64), w, "fp8")


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_int8_rows_do_not_depend_on_their_neighbours(type_name):
    """Q4_K and Q6_K take the vectorized int8 path in chunks of 8 activation rows where the build
    has one: a row's result is the same alone, in a chunk, and past the first chunk."""
    rows, cols = 40, 512
    w = as_tensor(type_name, random_tensor(type_name, rows, cols, seed=7), rows, cols)
    x = torch.randn(19, cols, generator=torch.Generator().manual_seed(9))
    many = gguf_matmul(x, w, "int8")
    for i in (0, 7, 8, 18):
        alone = gguf_matmul(x[i:i + 1].contiguous(), w, "int8")[0]
        torch.testing.assert_close(alone, many[i], rtol=1e-5, atol=1e-6 * float(many.abs().max()))


def test_layers_take_int8_only_where_it_is_vectorized():
    from pagedllm.quantization.kernels.gguf_kernel import part_compute

    vectorized = kernel_build.gguf_gemm_kernel().int8_vectorized(TYPES["Q4_K"])
    assert part_compute("Q4_K", "int8") == ("int8" if vectorized else "exact")
    assert part_compute("Q5_0", "int8") == "exact" and part_compute("F16", "int8") == "exact"
    assert part_compute("Q4_K", "exact") == "exact"


@pytest.mark.slow  # every GGUF type widened by gguf-py: 3 s
def test_without_the_kernel_every_type_still_widens_to_gguf_py_values():
    """PAGEDLLM_DISABLE_C_KERNELS=1 (or no compiler): layers widen with a warning, through torch
    for Q4_0 / Q4_1 / Q8_0 and gguf-py for the rest; the values are the same."""
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np, torch\n"
        "from pagedllm.quantization.kernels.gguf_kernel import GGUFTensor, kernel_takes\n"
        "from tests.gguf_random import ALL_TYPES, dequantized, random_tensor\n"
        "assert not kernel_takes('Q4_K', 256)\n"
        "for t in ALL_TYPES:\n"
        "    d = random_tensor(t, 4, 256)\n"
        "    g = GGUFTensor(torch.from_numpy(np.ascontiguousarray(d).view(np.uint8).reshape(4, -1)), t, (4, 256))\n"
        "    assert torch.equal(g.dequantize(), torch.from_numpy(dequantized(t, d, 4, 256))), t\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PAGEDLLM_DISABLE_C_KERNELS="1", PYTHONPATH=root)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)

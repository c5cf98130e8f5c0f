"""kernels/int_gemm.c against references written here in plain torch.

- unpack: the packed form stands for exactly `d * q + m` (m = -d * zero, or given);
- exact path: equal to dequantize-then-matmul up to float32 summation order (relative error of
  the output <= 1e-5);
- int8 path: equal to the same int8 arithmetic written in torch (activations quantized per
  block of 32 to int8, integer dots; <= 1e-5), and within 1e-2 of the float product. Why 1e-2
  holds: each activation moves by at most half a step, amax_b / 254 of its block's absmax, so a
  block's error is at most amax_b / 254 * sum |w|, and for the independent random signs here
  the errors add as a random walk: the relative output error is about 1/254 / sqrt(3) ~ 0.25%
  (0.3-0.4% measured), a quarter of the bound;
- every instruction-set path: the library rebuilt for AVX2 (`x86-64-v3`) and portable C
  (`x86-64`) runs the same checks in a subprocess, whatever this CPU has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pagedllm.quantization.kernels.int_kernel import (
    int_gemm_isa,
    int_matmul,
    kernel_supports,
    pack_int_weight,
    unpack_int_weight,
)

pytestmark = pytest.mark.skipif(int_gemm_isa() is None, reason="the int_gemm C kernel cannot be built here")


def _weight(n: int, k: int, bits: int, gs: int, kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    d = (torch.rand(n, k // gs, generator=g) * 0.02 + 0.001).half().float()  # float16 values
    if kind == "zero":
        offsets = torch.randint(0, 1 << bits, (n, k // gs), generator=g, dtype=torch.int32).to(torch.uint8)
        m = -d * offsets.float()
    else:
        offsets = (torch.randn(n, k // gs, generator=g) * 0.05).half().float()
        m = offsets
    w = codes.float().view(n, k // gs, gs) * d.unsqueeze(-1) + m.unsqueeze(-1)
    return codes, d, offsets, w.view(n, k)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _int8_reference(x: torch.Tensor, codes, d, offsets, gs: int) -> torch.Tensor:
    """The int8 path's arithmetic in plain torch (float64 sums)."""
    m_rows, k = x.shape
    xb = x.view(m_rows, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv).clamp(-127, 127)  # float32 product, round half to even
    xs = (amax / 127.0).double()
    dots = torch.einsum("mbi,nbi->mnb", xq.double(), codes.double().view(codes.shape[0], k // 32, 32))
    xsum = xs.squeeze(-1) * xq.double().sum(-1)  # [m, blocks]
    per_group = gs // 32
    dd = d.double().repeat_interleave(per_group, dim=1)  # [n, blocks]
    mm = (-d.double() * offsets.double() if offsets.dtype == torch.uint8 else offsets.double())
    mm = mm.repeat_interleave(per_group, dim=1)
    y = (dots * xs.squeeze(-1).unsqueeze(1) * dd.unsqueeze(0)).sum(-1) + xsum @ mm.T
    return y


SHAPES = [  # (M, N, K, group size)
    (1, 32, 64, 32), (3, 50, 192, 64), (8, 96, 128, 128), (16, 33, 96, 32), (17, 64, 256, 64),
    (40, 70, 192, 192), (300, 40, 64, 32),
]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kind", ["zero", "min"])
@pytest.mark.parametrize("m,n,k,gs", SHAPES)
def test_exact_and_int8_paths_match_the_references(bits, kind, m, n, k, gs):
    codes, d, offsets, w = _weight(n, k, bits, gs, kind, seed=m * 7 + n)
    packed = pack_int_weight(codes, d, offsets, bits, gs)
    assert torch.equal(unpack_int_weight(packed), w)  # bit for bit: d * q + m in float32
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    ref = x.double() @ w.double().T
    exact = int_matmul(x, packed, "exact")
    assert _rel(exact, ref) <= 1e-5
    int8 = int_matmul(x, packed, "int8")
    assert _rel(int8, _int8_reference(x, codes, d, offsets, gs)) <= 1e-5
    assert _rel(int8, ref) <= 1e-2


def test_zero_rows_and_blocks_of_zeros():
    codes, d, offsets, w = _weight(64, 128, 4, 32, "zero")
    packed = pack_int_weight(codes, d, offsets, 4, 32)
    g = torch.Generator().manual_seed(11)
    x = torch.zeros(5, 128)
    x[1, 32:64] = torch.randn(32, generator=g)  # other blocks all zero: scale 0 must not give NaN
    x[3] = torch.randn(128, generator=g)
    for path in ("exact", "int8"):
        y = int_matmul(x, packed, path)
        assert torch.isfinite(y).all()
        assert _rel(y, x.double() @ w.double().T) <= 1e-2
    assert int_matmul(torch.zeros(0, 128), packed).shape == (0, 64)


def test_bad_arguments_are_value_errors():
    codes, d, offsets, _ = _weight(32, 64, 4, 32, "zero")
    with pytest.raises(ValueError, match="group sizes that are multiples of 32"):
        pack_int_weight(codes, d, offsets, 4, 16)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        pack_int_weight(codes, d, offsets, 3, 32)
    with pytest.raises(ValueError, match="must both be"):
        pack_int_weight(codes, d[:, :1], offsets, 4, 32)
    with pytest.raises(ValueError, match="codes must be below 16"):
        pack_int_weight(codes | 16, d, offsets, 4, 32)
    packed = pack_int_weight(codes, d, offsets, 4, 32)
    with pytest.raises(ValueError, match="in-features"):
        int_matmul(torch.randn(2, 96), packed)
    with pytest.raises(ValueError, match="compute must be one of"):
        int_matmul(torch.randn(2, 64), packed, "fp8")
    assert not kernel_supports(4, 96, 64) and kernel_supports(8, 128, 64)


_CHILD = """
import json, sys, torch
from tests.unit import test_int_gemm as t
from pagedllm.quantization.kernels.int_kernel import int_gemm_isa
worst = {"exact": 0.0, "int8_vs_ref": 0.0, "int8_vs_float": 0.0}
for bits in (4, 8):
    for kind in ("zero", "min"):
        for (m, n, k, gs) in t.SHAPES[:6]:
            codes, d, offsets, w = t._weight(n, k, bits, gs, kind, seed=m + n)
            packed = t.pack_int_weight(codes, d, offsets, bits, gs)
            assert torch.equal(t.unpack_int_weight(packed), w)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
            ref = x.double() @ w.double().T
            worst["exact"] = max(worst["exact"], t._rel(t.int_matmul(x, packed, "exact"), ref))
            y8 = t.int_matmul(x, packed, "int8")
            worst["int8_vs_ref"] = max(worst["int8_vs_ref"], t._rel(y8, t._int8_reference(x, codes, d, offsets, gs)))
            worst["int8_vs_float"] = max(worst["int8_vs_float"], t._rel(y8, ref))
print(json.dumps({"isa": int_gemm_isa(), **worst}))
"""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split()[2:]}
    except OSError:
        return set()


@pytest.mark.slow  # builds the library twice more (~15 s each on 2 cores)
@pytest.mark.parametrize("march,isa", [("x86-64-v3", "avx2"), ("x86-64", "portable")])
def test_other_instruction_set_paths(tmp_path, march, isa):
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the -march targets here are x86-64 ones")
    if march == "x86-64-v3" and not {"avx2", "fma", "bmi2"} <= _cpu_flags():
        pytest.skip("this CPU cannot run AVX2 code")
    env = dict(os.environ, PAGEDLLM_KERNEL_MARCH=march, PAGEDLLM_CACHE_DIR=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["isa"] == isa
    assert result["exact"] <= 1e-5
    assert result["int8_vs_ref"] <= 1e-5
    assert result["int8_vs_float"] <= 1e-2

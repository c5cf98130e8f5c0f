"""Checks shared by the Triton kernel tests (tests/unit/test_triton_attention.py and
test_triton_int_gemm.py) that need no GPU: ahead-of-time compilation to CUDA binaries (the
compile-only sm_80 / sm_90 checks), and importing a kernel module where triton is missing.

Compilation: Triton's NVIDIA backend ships ptxas and cuobjdump in the triton wheel, so a CPU
machine can run the real compiler down to a cubin and read its resource usage.
`compile_to_cubin` compiles one source for a capability, checks that the PTX targets it and that
ptxas assembled it without register spills (cuobjdump's `LOCAL:0`), and returns the PTX for
instruction checks. The caller unsets TRITON_INTERPRET first (the kernels are jitted per mode:
an interpreted one does not compile).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

try:  # optional: the CPU install has no Triton
    import triton
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


def _bin(name: str) -> str:
    return os.path.join(triton.__path__[0], "backends", "nvidia", "bin", name)


def ptxas_available() -> bool:
    """Whether triton and its NVIDIA backend's ptxas and cuobjdump are installed."""
    return triton is not None and all(os.path.exists(_bin(b)) for b in ("ptxas", "cuobjdump"))


needs_ptxas = pytest.mark.skipif(not ptxas_available(),
                                 reason="triton's NVIDIA backend (ptxas, cuobjdump) is not installed")


def compile_to_cubin(src, capability: int, options: dict, tmp_path, name: str) -> str:
    """Compile `src` (a triton.compiler.ASTSource) for sm_`capability` with the launch `options`
    (num_warps, num_stages), write the cubin under `tmp_path` as `name`.cubin, assert the PTX
    targets that capability and the binary spills no registers; the PTX."""
    from triton.backends.compiler import GPUTarget

    kernel = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
    ptx = kernel.asm["ptx"]
    assert f".target sm_{capability}" in ptx
    cubin = tmp_path / f"{name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([_bin("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                           text=True, check=True).stdout
    assert re.search(r"\bREG:\d+", usage), usage
    assert re.search(r"\bLOCAL:0\b", usage), f"{name}: register spills: {usage}"
    return ptx


def assert_needs_triton_without_it(module: str, call: str, checks: str = "") -> None:
    """In a fresh interpreter where triton cannot be imported: `module` imports (as `t`) with
    `HAS_TRITON` false, the Python lines `checks` pass, and `call` raises the RuntimeError that
    names the missing triton package."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        f"import {module} as t\n"
        "assert not t.HAS_TRITON\n"
        f"{checks}"
        "try:\n"
        f"    {call}\n"
        "except RuntimeError as e:\n"
        "    assert 'needs the triton package' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

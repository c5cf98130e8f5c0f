"""Build a C kernel into a shared library once per source and machine, then load it with ctypes.

Why C and ctypes rather than a torch C++ extension: the file compiles in about a second with
plain gcc (no torch headers, no ninja), and the call costs microseconds. The library links
`libgomp.so.1`, the soname torch itself ships and has already loaded, so the kernel's OpenMP
threads are torch's own pool (no second pool competing for the cores).

Libraries are cached under `$PAGEDLLM_CACHE_DIR/kernels`, keyed by a hash of the source, the
flags and the CPU, and written atomically so that concurrent processes can share the cache.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from pagedllm.model_source import cache_dir

logger = logging.getLogger(__name__)

DISABLE_ENV = "PAGEDLLM_DISABLE_C_KERNELS"
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_SOURCE_DIR = Path(__file__).parent
_LOCAL_INCLUDE = re.compile(rb'^#include "([^"]+)"', re.MULTILINE)  # part of the cache key
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _cpu_signature() -> str:
    """The CPU model and flags: `-march=native` code is valid only where they match."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def build_library(source_name: str) -> ctypes.CDLL | None:
    """Compile (if not cached) and load `kernels/<source_name>`; None if that is impossible."""
    with _lock:
        if source_name in _loaded:
            return _loaded[source_name]
        _loaded[source_name] = lib = _build(source_name)
        return lib


def _build(source_name: str) -> ctypes.CDLL | None:
    if os.environ.get(DISABLE_ENV, "0") not in ("", "0"):
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("No C compiler found: %s falls back to plain torch", source_name)
        return None
    source = (_SOURCE_DIR / source_name).read_bytes()
    included = b"".join((_SOURCE_DIR / name.decode()).read_bytes() for name in _LOCAL_INCLUDE.findall(source))
    key = hashlib.sha256(
        source + included + " ".join(_CFLAGS).encode() + _cpu_signature().encode() + compiler.encode()
    ).hexdigest()[:16]
    out_dir = cache_dir() / "kernels"
    target = out_dir / f"{Path(source_name).stem}-{key}.so"
    if not target.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [compiler, *_CFLAGS, str(_SOURCE_DIR / source_name), "-o", tmp, "-lm"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            error = proc.stderr if proc.returncode != 0 else None
        except OSError as exc:  # the compiler cannot be run
            error = str(exc)
        if error is not None:
            os.unlink(tmp)
            logger.warning("Building %s failed, falling back to plain torch:\n%s", source_name, error)
            return None
        os.replace(tmp, target)
    try:
        import torch  # noqa: F401  (loads torch's libgomp first, so that the kernel shares it)

        return ctypes.CDLL(str(target))
    except OSError as exc:
        logger.warning("Loading %s failed, falling back to plain torch: %s", target, exc)
        return None


@functools.cache
def _kernel_function(source_name: str, symbol: str, argtypes: tuple, restype=ctypes.c_int):
    lib = build_library(source_name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn


_PTR, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


def decode_attention_kernel():
    """The `paged_decode_attention_f32` C function (built and loaded once), or None."""
    return _kernel_function(
        "paged_decode_attention.c",
        "paged_decode_attention_f32",
        (_PTR, _I64, _PTR, _PTR, _I64) + (_PTR,) * 6 + (_I32,) * 6 + (_I64, ctypes.c_float, _I32, _I32),
    )


def prefill_attention_kernel():
    """The `paged_prefill_attention_f32` C function (built and loaded once), or None."""
    return _kernel_function(
        "paged_prefill_attention.c",
        "paged_prefill_attention_f32",
        (_PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I32) + (_PTR,) * 3
        + (_I32, _PTR) + (_I32,) * 4 + (_I64, ctypes.c_float, _I32, _I32),
    )


class PackedGemm(NamedTuple):
    """The three functions of `packed_gemm.c` (see there for the packed layout)."""

    packed_size: Callable[..., int]  # (N, K) -> floats in the packed weight
    pack: Callable[..., None]  # (w, wp, N, K)
    gemm: Callable[..., int]  # (x, wp, y, scratch, M, N, K, threads) -> 0 on success


@functools.cache
def packed_gemm_kernel() -> PackedGemm | None:
    """The packed-weight GEMM of `packed_gemm.c` (built and loaded once), or None."""
    size = _kernel_function("packed_gemm.c", "packed_weight_size", (_I64, _I64), _I64)
    if size is None:
        return None
    pack = _kernel_function("packed_gemm.c", "pack_weight_f32", (_PTR, _PTR, _I64, _I64), None)
    gemm = _kernel_function("packed_gemm.c", "packed_gemm_f32", (_PTR,) * 4 + (_I64,) * 3 + (_I32,))
    return PackedGemm(size, pack, gemm)


class BlockGemm(NamedTuple):
    """The three functions of `block_gemm.c` (see there for the formats and the layout)."""

    packed_size: Callable[..., int]  # (format, N, K) -> bytes of the packed weight
    pack: Callable[..., None]  # (format, codes, scales, offsets, out, N, K)
    gemm: Callable[..., int]  # (format, x, packed, y, scratch, M, N, K, threads) -> 0 on success


@functools.cache
def block_gemm_kernel() -> BlockGemm | None:
    """The block-format GEMM of `block_gemm.c` (built and loaded once), or None."""
    size = _kernel_function("block_gemm.c", "block_packed_size", (_I32, _I64, _I64), _I64)
    if size is None:
        return None
    pack = _kernel_function("block_gemm.c", "block_pack", (_I32,) + (_PTR,) * 4 + (_I64, _I64), None)
    gemm = _kernel_function("block_gemm.c", "block_gemm_f32", (_I32,) + (_PTR,) * 4 + (_I64,) * 3 + (_I32,))
    return BlockGemm(size, pack, gemm)


class FusedOps(NamedTuple):
    """The functions of `fused_ops.c`."""

    add_rms_norm: Callable[..., None]  # (x, residual, weight, out, M, H, eps, add, threads)
    silu_mul: Callable[..., None]  # (gate_up, out, M, I, threads)
    rotary: Callable[..., None]  # (qkv, cos, sin, T, row_stride, heads, D, threads)


@functools.cache
def fused_ops_kernel() -> FusedOps | None:
    """The fused per-layer operations of `fused_ops.c` (built and loaded once), or None."""
    norm = _kernel_function("fused_ops.c", "add_rms_norm_f32", (_PTR,) * 4 + (_I64, _I64, ctypes.c_float, _I32, _I32), None)
    if norm is None:
        return None
    silu = _kernel_function("fused_ops.c", "silu_mul_f32", (_PTR, _PTR, _I64, _I64, _I32), None)
    rotary = _kernel_function("fused_ops.c", "rotary_f32", (_PTR,) * 3 + (_I64,) * 4 + (_I32,), None)
    return FusedOps(norm, silu, rotary)

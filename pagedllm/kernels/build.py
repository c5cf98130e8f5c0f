"""Build a C kernel into a shared library once per source and machine, then load it with ctypes.

Why C and ctypes rather than a torch C++ extension: the file compiles in about a second with
plain gcc (no torch headers, no ninja), and the call costs microseconds. The library links
`libgomp.so.1`, the soname torch itself ships and has already loaded, so the kernel's OpenMP
threads are torch's own pool (no second pool competing for the cores).

Libraries are cached under `$PAGEDLLM_CACHE_DIR/kernels`, keyed by a hash of the source, the
flags and the CPU, and written atomically so that concurrent processes can share the cache.

The boundary with the process around it:
- Floating-point mode: sources are compiled with `-ffast-math`, but linked without it. gcc adds
  `crtfastmath.o` to any link that has `-ffast-math` (or `-Ofast`) on its command line, and that
  object's constructor switches the whole process to flush-to-zero / denormals-are-zero when the
  library is loaded: torch's, numpy's and the user's own float arithmetic would change.
- Never fatal: no compiler, a compiler that fails or hangs (`PAGEDLLM_KERNEL_BUILD_TIMEOUT`
  seconds, default 120), a cache folder that cannot be written, a library that does not load:
  each leaves that kernel on its torch path, with one warning. A compiler that cannot run or
  hangs is not tried again for the other kernels.
- Trust: a cached library (or its folder) owned by another user or writable by group or others
  is refused, since loading it runs its code; the build writes both private to their owner.
- `kernel_state(source)` says for each library whether it is loaded and, if not, why;
  kernels/status.py turns that into the start-up line, `pagedllm --version` and the
  `pagedllm:kernel_info` metric.
- Instruction set: each library is built for one variant of kernels/isa.py (AVX-512, AVX2, ...),
  the best this CPU runs, chosen when it loads; the variant's flags (not the CPU) key the cache,
  except for `-march=native` builds. Every accessor takes `variant=` to load another one
  (benchmarks/kernel_matrix.py and the tests run each variant this CPU can run).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from pagedllm import envs
from pagedllm.kernels.isa import KernelVariant, by_name, select_variant
from pagedllm.model_source import CACHE_DIR_ENV, cache_dir

logger = logging.getLogger(__name__)

DISABLE_ENV = "PAGEDLLM_DISABLE_C_KERNELS"
TIMEOUT_ENV = "PAGEDLLM_KERNEL_BUILD_TIMEOUT"
DEFAULT_BUILD_TIMEOUT_S = 120.0
# Compiled objects get the fast-math flags; the link step must not (see the module docstring).
_CFLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
_LDFLAGS = ["-shared", "-fopenmp"]
_BUILD_RECIPE_VERSION = 3  # part of the cache key: 1 linked with -ffast-math (crtfastmath.o); 2 -march=native
_SOURCE_DIR = Path(__file__).parent
_LOCAL_INCLUDE = re.compile(rb'^#include "([^"]+)"', re.MULTILINE)  # part of the cache key
_lock = threading.Lock()
_loaded: dict[tuple[str, str], ctypes.CDLL | None] = {}  # (source, variant name) -> library


class KernelState(NamedTuple):
    """Whether a kernel library is loaded; `reason`: its path if it is, else why it is not."""

    active: bool
    reason: str
    variant: str = ""  # the instruction-set variant it was built for (kernels/isa.py)


_status: dict[tuple[str, str], KernelState] = {}
_broken_compiler: str | None = None  # why the compiler is not tried again (cannot run, hung)


def kernel_sources() -> list[str]:
    """Every kernel source of this package (each is a library of its own)."""
    return sorted(p.name for p in _SOURCE_DIR.glob("*.c"))


def _cpu_signature() -> str:
    """The CPU model and flags: `-march=native` code is valid only where they match."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _variant(name: str | None) -> tuple[KernelVariant | None, str]:
    """The variant called `name` (None: this process's choice, kernels/isa.select_variant), or
    None and why it cannot run here."""
    if name is None:
        choice = select_variant()
        return choice.variant, choice.how
    variant = by_name(name)
    return variant, f"variant {name}" if variant is not None else f"unknown kernel variant {name!r}"


def _key(source_name: str, variant: str | None) -> tuple[tuple[str, str], KernelVariant | None, str]:
    chosen, how = _variant(variant)
    return (source_name, chosen.name if chosen is not None else f"none: {how}"), chosen, how


def build_library(source_name: str, variant: str | None = None) -> ctypes.CDLL | None:
    """Compile (if not cached) and load `kernels/<source_name>` for `variant` (None: the one this
    CPU runs best); None if that is impossible."""
    key = _key(source_name, variant)[0]
    with _lock:
        if key in _loaded:
            return _loaded[key]
        _loaded[key] = lib = _build(source_name, variant)
        return lib


def kernel_state(source_name: str, variant: str | None = None) -> KernelState:
    """Build or load `source_name` if not tried yet, and say whether it is active and why."""
    build_library(source_name, variant)
    return _status.get(_key(source_name, variant)[0], KernelState(False, "not built"))


def _build(source_name: str, variant: str | None = None) -> ctypes.CDLL | None:
    """Build or load one library now (no memo) and record its state."""
    key, chosen, how = _key(source_name, variant)
    if chosen is None:
        lib, reason = _fail(source_name, how)
    else:
        try:
            lib, reason = _build_or_load(source_name, chosen)
        except Exception as exc:  # never take the engine down for a kernel
            lib, reason = None, f"unexpected error while building ({type(exc).__name__}: {exc})"
            logger.warning("C kernel %s: %s; falling back to plain torch", source_name, reason)
    _status[key] = KernelState(lib is not None, reason, chosen.name if chosen is not None else "")
    return lib


def _fail(source_name: str, reason: str, detail: str = "") -> tuple[None, str]:
    """One warning for this library (the caller caches the outcome: never one per call)."""
    logger.warning("C kernel %s is off, falling back to plain torch (slower): %s%s", source_name, reason, detail)
    return None, reason


def _unsafe(path: Path) -> str | None:
    """Why a cached library (or its folder) must not be trusted, or None: loading a library runs
    its code, so it must be ours and writable only by us."""
    st = path.stat()
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    if uid is not None and st.st_uid != uid:
        return f"refusing {path}: owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"refusing {path}: writable by group or others (mode {stat.filemode(st.st_mode)})"
    return None


def _compiler() -> tuple[list[str] | None, str]:
    """The compiler command (`$CC`, else gcc, else cc), or None and why there is none."""
    cc = envs.CC
    if cc:
        cmd = shlex.split(cc)
        if cmd and shutil.which(cmd[0]):
            return cmd, cc
        return None, f"the C compiler CC={cc!r} is not found (install gcc or fix CC)"
    found = shutil.which("gcc") or shutil.which("cc")
    if found is None:
        return None, "no C compiler found (install gcc or set CC)"
    return [found], found


def _build_timeout() -> float:
    try:
        return envs.PAGEDLLM_KERNEL_BUILD_TIMEOUT
    except ValueError as exc:  # a kernel build is never fatal: say so, use the default
        logger.warning("%s; using %g s", exc, DEFAULT_BUILD_TIMEOUT_S)
        return DEFAULT_BUILD_TIMEOUT_S


def _run(cmd: list[str], timeout: float) -> str | None:
    """Run one compiler command; its error text, or None on success. A command past `timeout`
    is killed with everything it started (its own process group)."""
    global _broken_compiler
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    except OSError as exc:
        _broken_compiler = f"the C compiler {cmd[0]} cannot be run ({exc})"
        return _broken_compiler
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.communicate()
        _broken_compiler = (f"the C compiler timed out after {timeout:g} s (set {TIMEOUT_ENV} "
                            f"to allow more)")
        return _broken_compiler
    return None if proc.returncode == 0 else f"{cmd[0]} exited with {proc.returncode}:\n{output}"


def _first_error(output: str) -> str:
    """The line of a compiler's output that says what went wrong (for the one-line reason)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines[1:] if "error" in ln.lower()]
    first = lines[0] if lines else "build failed"
    return (f"{first} {errors[0]}" if errors else " ".join(lines[:2]))[:300]


def _build_or_load(source_name: str, variant: KernelVariant) -> tuple[ctypes.CDLL | None, str]:
    global _broken_compiler
    if envs.PAGEDLLM_DISABLE_C_KERNELS:
        return None, f"disabled by {DISABLE_ENV}=1"
    if _broken_compiler is not None:
        logger.debug("C kernel %s not built: %s", source_name, _broken_compiler)
        return None, _broken_compiler
    compiler, compiler_name = _compiler()
    if compiler is None:
        _broken_compiler = compiler_name
        return _fail(source_name, compiler_name)
    cflags = [*variant.flags, *_CFLAGS]
    source = (_SOURCE_DIR / source_name).read_bytes()
    included = b"".join((_SOURCE_DIR / name.decode()).read_bytes() for name in _included(source))
    recipe = f"{_BUILD_RECIPE_VERSION} {' '.join(cflags)} | {' '.join(_LDFLAGS)} | {compiler_name}"
    cpu = _cpu_signature() if variant.per_cpu else ""  # named variants run on any CPU with their flags
    key = hashlib.sha256(source + included + recipe.encode() + cpu.encode()).hexdigest()[:16]
    out_dir = cache_dir() / "kernels"
    target = out_dir / f"{Path(source_name).stem}-{variant.name.replace('=', '-')}-{key}.so"
    if not target.exists():
        try:
            out_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
            problem = _unsafe(out_dir)
            if problem is not None:
                return _fail(source_name, problem)
            work = Path(tempfile.mkdtemp(prefix=".build-", dir=out_dir))
        except OSError as exc:
            return _fail(source_name, f"cannot write the kernel cache {out_dir} ({exc}); set {CACHE_DIR_ENV} "
                                      "to a writable folder")
        try:
            obj, lib = work / "kernel.o", work / "kernel.so"
            timeout = _build_timeout()
            error = _run([*compiler, *cflags, "-c", str(_SOURCE_DIR / source_name), "-o", str(obj)], timeout)
            if error is None:
                error = _run([*compiler, *_LDFLAGS, str(obj), "-o", str(lib), "-lm"], timeout)
            if error is not None:
                return _fail(source_name, _first_error(error), "\n" + error)
            lib.chmod(0o755)  # whatever the umask: others must not be able to replace it
            os.replace(lib, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    for path in (out_dir, target):
        problem = _unsafe(path)
        if problem is not None:
            return _fail(source_name, problem)
    try:
        import torch  # noqa: F401  (loads torch's libgomp first, so that the kernel shares it)

        return ctypes.CDLL(str(target)), f"loaded {target}"
    except OSError as exc:
        return _fail(source_name, f"loading {target} failed: {exc}")


def _included(source: bytes) -> list[bytes]:
    """The local headers and sources `source` includes, transitively (they are in its key)."""
    names: list[bytes] = []
    for name in _LOCAL_INCLUDE.findall(source):
        if name not in names:
            names.append(name)
            names += [n for n in _included((_SOURCE_DIR / name.decode()).read_bytes()) if n not in names]
    return names


def _kernel_function(source_name: str, symbol: str, argtypes: tuple, restype=ctypes.c_int,
                     variant: str | None = None):
    chosen, how = _variant(variant)
    return _bound_function(source_name, symbol, argtypes, restype, variant, chosen.name if chosen else how)


@functools.cache
def _bound_function(source_name: str, symbol: str, argtypes: tuple, restype, variant: str | None,
                    chosen: str):
    """One bound symbol per (library, chosen variant): `chosen` is in the key only."""
    lib = build_library(source_name, variant)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn


_PTR, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


def decode_attention_kernel(variant: str | None = None):
    """The `paged_decode_attention` C function (built and loaded once), or None. Its first
    argument is the cache's element kind (layers/kv_cache_dtype.KERNEL_KIND)."""
    return _kernel_function(
        "paged_decode_attention.c",
        "paged_decode_attention",
        (_I32, _PTR, _I64, _PTR, _PTR, _I64) + (_PTR,) * 6 + (_I32,) * 6 + (_I64, ctypes.c_float, _I32, _I32), variant=variant)


def prefill_attention_kernel(variant: str | None = None):
    """The `paged_prefill_attention` C function (built and loaded once), or None (first
    argument: the cache's element kind, as for decode)."""
    return _kernel_function(
        "paged_prefill_attention.c",
        "paged_prefill_attention",
        (_I32, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I32) + (_PTR,) * 3
        + (_I32, _PTR) + (_I32,) * 4 + (_I64, ctypes.c_float, _I32, _I32), variant=variant)


def bf16_round_kernel(variant: str | None = None):
    """`kv_bf16_round(src, dst, n, portable)` of kernels/kv_cache_types.h (the tests check both
    of its paths against torch), or None."""
    return _kernel_function("paged_decode_attention.c", "kv_bf16_round", (_PTR, _PTR, _I64, _I32), None, variant=variant)


class PackedGemm(NamedTuple):
    """The three functions of `packed_gemm.c` (see there for the packed layout)."""

    packed_size: Callable[..., int]  # (N, K) -> floats in the packed weight
    pack: Callable[..., None]  # (w, wp, N, K)
    gemm: Callable[..., int]  # (x, wp, y, scratch, M, N, K, threads) -> 0 on success


@functools.cache  # the default variant's memo (None) and each named one
def packed_gemm_kernel(variant: str | None = None) -> PackedGemm | None:
    """The packed-weight GEMM of `packed_gemm.c` (built and loaded once), or None."""
    size = _kernel_function("packed_gemm.c", "packed_weight_size", (_I64, _I64), _I64, variant=variant)
    if size is None:
        return None
    pack = _kernel_function("packed_gemm.c", "pack_weight_f32", (_PTR, _PTR, _I64, _I64), None, variant=variant)
    gemm = _kernel_function("packed_gemm.c", "packed_gemm_f32", (_PTR,) * 4 + (_I64,) * 3 + (_I32,), variant=variant)
    return PackedGemm(size, pack, gemm)


class IntGemm(NamedTuple):
    """The functions of `int_gemm.c` (see there for the layout and the two arithmetic paths)."""

    packed_size: Callable[..., int]  # (bits, kind, N, K, gs) -> bytes, -1 if unsupported
    pack: Callable[..., int]  # (bits, kind, codes, d, offsets, out, N, K, gs)
    unpack: Callable[..., int]  # (bits, kind, packed, w, N, K, gs)
    exact: Callable[..., int]  # (bits, kind, x, packed, y, scratch, M, N, K, gs, threads)
    int8: Callable[..., int]  # (bits, kind, x, packed, y, scratch, M, N, K, gs, threads)
    int8_scratch: Callable[..., int]  # (M, K) -> bytes of scratch for `int8`
    isa: Callable[..., int]  # () -> 3 AVX-512 VNNI, 2 AVX-VNNI, 1 AVX2, 0 portable C
    rows: Callable[..., int]  # (bits, kind, packed, ids, n_ids, out, N, K, gs): embedding lookup


@functools.cache
def int_gemm_kernel(variant: str | None = None) -> IntGemm | None:
    """The integer-weight GEMM of `int_gemm.c` (built and loaded once), or None."""
    src = "int_gemm.c"
    size = _kernel_function(src, "int_gemm_packed_size", (_I32, _I32, _I64, _I64, _I64), _I64, variant=variant)
    if size is None:
        return None
    return IntGemm(
        size,
        _kernel_function(src, "int_gemm_pack", (_I32, _I32) + (_PTR,) * 4 + (_I64,) * 3, variant=variant),
        _kernel_function(src, "int_gemm_unpack", (_I32, _I32, _PTR, _PTR) + (_I64,) * 3, variant=variant),
        _kernel_function(src, "int_gemm_exact", (_I32, _I32) + (_PTR,) * 4 + (_I64,) * 4 + (_I32,), variant=variant),
        _kernel_function(src, "int_gemm_int8", (_I32, _I32) + (_PTR,) * 4 + (_I64,) * 4 + (_I32,), variant=variant),
        _kernel_function(src, "int_gemm_int8_scratch", (_I64, _I64), _I64, variant=variant),
        _kernel_function(src, "int_gemm_isa", (), variant=variant),
        _kernel_function(src, "int_gemm_rows", (_I32, _I32, _PTR, _PTR, _I64, _PTR) + (_I64,) * 3, variant=variant),
    )


class GGUFGemm(NamedTuple):
    """The functions of `gguf_gemm.c` (GGUF blocks read in place; see there)."""

    block_length: Callable[..., int]  # (type) -> weights per block, 0 if not taken
    block_bytes: Callable[..., int]  # (type) -> bytes per block
    rows: Callable[..., int]  # (type, w, ids, n_ids, out, N, K, threads): embedding lookup
    exact: Callable[..., int]  # (type, x, w, y, scratch, M, N, K, ldy, threads)
    int8: Callable[..., int]  # (type, x, w, y, scratch, M, N, K, ldy, threads)
    int8_scratch: Callable[..., int]  # (M, K) -> bytes of scratch for `int8`
    isa: Callable[..., int]  # () -> as int_gemm_isa
    int8_vectorized: Callable[..., int]  # (type) -> 1 if the int8 path has a vector kernel for it


@functools.cache
def gguf_gemm_kernel(variant: str | None = None) -> GGUFGemm | None:
    """The GGUF-block GEMM of `gguf_gemm.c` (built and loaded once), or None."""
    src = "gguf_gemm.c"
    length = _kernel_function(src, "gguf_block_length", (_I32,), variant=variant)
    if length is None:
        return None
    return GGUFGemm(
        length,
        _kernel_function(src, "gguf_block_bytes", (_I32,), variant=variant),
        _kernel_function(src, "gguf_rows", (_I32, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I32), variant=variant),
        _kernel_function(src, "gguf_gemm_exact", (_I32,) + (_PTR,) * 4 + (_I64,) * 4 + (_I32,), variant=variant),
        _kernel_function(src, "gguf_gemm_int8", (_I32,) + (_PTR,) * 4 + (_I64,) * 4 + (_I32,), variant=variant),
        _kernel_function(src, "gguf_int8_scratch", (_I64, _I64), _I64, variant=variant),
        _kernel_function(src, "gguf_gemm_isa", (), variant=variant),
        _kernel_function(src, "gguf_int8_vectorized", (_I32,), variant=variant),
    )


class FusedOps(NamedTuple):
    """The functions of `fused_ops.c`."""

    add_rms_norm: Callable[..., None]  # (x, residual, weight, out, M, H, eps, add, threads)
    silu_mul: Callable[..., None]  # (gate_up, out, M, I, threads)
    gelu_tanh_mul: Callable[..., None]  # (gate_up, out, M, I, threads)
    rotary: Callable[..., None]  # (qkv, cos, sin, T, row_stride, heads, D, threads)
    argmax_rows: Callable[..., None]  # (x, M, V, ld, out int64, threads)


@functools.cache
def fused_ops_kernel(variant: str | None = None) -> FusedOps | None:
    """The fused per-layer operations of `fused_ops.c` (built and loaded once), or None."""
    norm = _kernel_function("fused_ops.c", "add_rms_norm_f32", (_PTR,) * 4 + (_I64, _I64, ctypes.c_float, _I32, _I32), None, variant=variant)
    if norm is None:
        return None
    silu = _kernel_function("fused_ops.c", "silu_mul_f32", (_PTR, _PTR, _I64, _I64, _I32), None, variant=variant)
    gelu = _kernel_function("fused_ops.c", "gelu_tanh_mul_f32", (_PTR, _PTR, _I64, _I64, _I32), None, variant=variant)
    rotary = _kernel_function("fused_ops.c", "rotary_f32", (_PTR,) * 3 + (_I64,) * 4 + (_I32,), None, variant=variant)
    argmax = _kernel_function("fused_ops.c", "argmax_rows_f32", (_PTR, _I64, _I64, _I64, _PTR, _I32), None,
                              variant=variant)
    return FusedOps(norm, silu, gelu, rotary, argmax)


class LoraKernel(NamedTuple):
    """The functions of `lora.c` (see there for the tiles)."""

    sgmv: Callable[..., int]  # (x, ldx, w, S, L, y, ldy, T, idx, n_slices, sizes, accumulate, threads)
    vector_width: Callable[..., int]  # () -> floats per vector of this build


@functools.cache
def lora_kernel(variant: str | None = None) -> LoraKernel | None:
    """The batched multi-LoRA shrink / expand of `lora.c` (built and loaded once), or None."""
    sgmv = _kernel_function("lora.c", "lora_sgmv", (_PTR, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I32, _PTR,
                                                    _I32, _I32), variant=variant)
    if sgmv is None:
        return None
    return LoraKernel(sgmv, _kernel_function("lora.c", "lora_vector_width", (), variant=variant))


class DecodeStepKernel(NamedTuple):
    """The functions of `decode_step.c` (one decode step of a dense decoder per call)."""

    run: Callable[..., int]  # (ops, model, layers, embedded, cos, sin, slots, tables, ctx, out, work, scratch, M, threads)
    work_floats: Callable[..., int]  # (model, M) -> floats of the work buffer


@functools.cache
def decode_step_kernel(variant: str | None = None) -> DecodeStepKernel | None:
    """The C decode step of `decode_step.c` (built and loaded once), or None."""
    run = _kernel_function("decode_step.c", "decode_step_run", (_PTR,) * 12 + (_I64, _I32), variant=variant)
    if run is None:
        return None
    return DecodeStepKernel(run, _kernel_function("decode_step.c", "decode_step_work_floats", (_PTR, _I64), _I64,
                                                  variant=variant))


def prebuild(variants: list[str] | None = None, jobs: int | None = None) -> dict[tuple[str, str], KernelState]:
    """Build (or find cached) every kernel source for each of `variants` (None: the one this CPU
    runs best), `jobs` compilers at a time: what an install step or a test set-up runs once so
    that no engine start-up (or test) waits on a compiler. Returns each library's state."""
    from concurrent.futures import ThreadPoolExecutor

    names: list[str | None] = list(variants) if variants else [None]
    pairs = [(source, variant) for variant in names for source in kernel_sources()]

    def build(pair: tuple[str, str | None]) -> KernelState:
        _build(*pair)  # not build_library: its lock would make the compilers take turns
        return _status[_key(*pair)[0]]

    with ThreadPoolExecutor(max_workers=max(1, jobs or os.cpu_count() or 1)) as pool:
        states = list(pool.map(build, pairs))
    return {(source, state.variant or str(variant)): state for (source, variant), state in zip(pairs, states)}


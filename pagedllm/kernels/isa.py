"""Which instruction-set variant of the C kernels runs here, chosen from the CPU's features when
the library loads (not from the machine that built or installed pagedllm).

Every kernel source is written once, with its register tiles sized by the vector width and
register count the compiler targets (`#if defined(__AVX512F__)` ...). A *variant* is one set of
compiler flags naming an instruction set; each variant is built into its own library, keyed by
its flags only (not by the CPU), so a cache or image made on one machine serves every machine
with those features, and a machine without them never loads it.

x86-64, best first (flags as /proc/cpuinfo names them):
- `avx512-vnni-bf16`: x86-64-v4 + AVX512-VNNI + AVX512-BF16 (Zen4/Zen5, Sapphire Rapids, ...);
- `avx512-vnni`: x86-64-v4 + AVX512-VNNI (Ice Lake, Cascade Lake);
- `avx512`: x86-64-v4 (Skylake-SP);
- `avx2-vnni`: x86-64-v3 + AVX-VNNI (Alder Lake and later client chips);
- `avx2`: x86-64-v3 (Haswell and later, Zen1-Zen3);
- `portable`: baseline x86-64 (SSE2).
Other machines: `native` (`-march=native`, keyed by the CPU) then `portable` (the compiler's
default target).

`PAGEDLLM_KERNEL_MARCH` forces one: a variant name, an `-march` level that maps to one
(`x86-64-v4` -> avx512, `x86-64-v3` -> avx2, `x86-64` -> portable), `native`, or any other
`-march` value (built as given, keyed by the CPU). A forced variant this CPU cannot run is
refused (the kernels stay off, with the reason), never loaded into a SIGILL.

AMX (Sapphire Rapids): no variant. The kernels' products are decode-sized (1-128 rows) against
weights streamed once per step, where AMX's tile loads and its 16x64 int8 tile shape do not pay;
torch's oneDNN already uses AMX for large bf16/int8 products, and the per-shape choice against
torch (layers/kernel_choice.py) keeps that wherever it is faster.
"""

from __future__ import annotations

import functools
import platform
from typing import NamedTuple

from pagedllm import envs

MARCH_ENV = "PAGEDLLM_KERNEL_MARCH"

_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


class KernelVariant(NamedTuple):
    name: str
    flags: tuple[str, ...]  # compiler flags that select the instruction set
    requires: frozenset[str]  # CPU flags (/proc/cpuinfo) it needs
    per_cpu: bool = False  # code valid only on this CPU model (-march=native / a custom -march)


X86_VARIANTS = (
    KernelVariant("avx512-vnni-bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
                  _V4 | {"avx512_vnni", "avx512_bf16"}),
    KernelVariant("avx512-vnni", ("-march=x86-64-v4", "-mavx512vnni"), _V4 | {"avx512_vnni"}),
    KernelVariant("avx512", ("-march=x86-64-v4",), _V4),
    KernelVariant("avx2-vnni", ("-march=x86-64-v3", "-mavxvnni"), _V3 | {"avx_vnni"}),
    KernelVariant("avx2", ("-march=x86-64-v3",), _V3),
    KernelVariant("portable", ("-march=x86-64",), frozenset()),
)
NATIVE = KernelVariant("native", ("-march=native",), frozenset(), per_cpu=True)
GENERIC = KernelVariant("portable", (), frozenset())  # non-x86: the compiler's default target
_MARCH_ALIASES = {"x86-64-v4": "avx512", "x86-64-v3": "avx2", "x86-64": "portable"}


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """Every flag /proc/cpuinfo lists for this CPU (empty where it cannot be read); read once."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(w for ln in f if ln.startswith(("flags", "Features"))
                             for w in ln.split(":", 1)[1].split())
    except (OSError, IndexError):
        return frozenset()


def variants() -> tuple[KernelVariant, ...]:
    """The variants of this architecture, best first."""
    return X86_VARIANTS if is_x86() else (NATIVE, GENERIC)


def runnable_variants(flags: frozenset[str] | None = None) -> list[KernelVariant]:
    """The variants this CPU can run, best first."""
    flags = cpu_flags() if flags is None else flags
    return [v for v in variants() if v.requires <= flags]


def by_name(name: str) -> KernelVariant | None:
    name = _MARCH_ALIASES.get(name, name) if is_x86() else name
    return next((v for v in (*variants(), NATIVE) if v.name == name), None)


class Choice(NamedTuple):
    variant: KernelVariant | None  # None: the forced one cannot run here
    how: str  # why this one: "chosen from the CPU's features" / "forced by ..."


def select_variant(flags: frozenset[str] | None = None) -> Choice:
    """The variant to build and load in this process."""
    flags = cpu_flags() if flags is None else flags
    forced = envs.PAGEDLLM_KERNEL_MARCH
    if forced:
        variant = by_name(forced)
        how = f"forced by {MARCH_ENV}={forced}"
        if variant is None:  # any other -march value, as given
            return Choice(KernelVariant(f"march={forced}", (f"-march={forced}",), frozenset(), True), how)
        missing = sorted(variant.requires - flags)
        if missing:
            return Choice(None, f"{how}, but this CPU lacks {' '.join(missing)}")
        return Choice(variant, how)
    runnable = runnable_variants(flags)
    return Choice(runnable[0], "chosen from the CPU's features")

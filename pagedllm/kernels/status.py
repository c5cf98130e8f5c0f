"""Which path runs: the C kernels that are active (and why one is not), the instruction-set
variant they were built for and why that one (kernels/isa.py), and the CPU's features.

Reported in three places, so that a user without a compiler (a slim image, macOS) sees that
they are on the slow torch path: one line at engine start-up (`log_kernel_status`),
`pagedllm --version`, and the `pagedllm:kernel_info` metric on `/metrics`.
"""

from __future__ import annotations

import logging
import platform
from typing import NamedTuple

from pagedllm.kernels.build import DISABLE_ENV, KernelState, kernel_sources, kernel_state
from pagedllm.kernels.isa import select_variant

logger = logging.getLogger(__name__)

# The instruction-set extensions the kernels' code generation can use, as /proc/cpuinfo names them.
_ISA_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512dq", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",  # x86-64
    "asimd", "asimddp", "sve", "sve2", "bf16", "i8mm",  # aarch64 ("Features")
)


def cpu_features() -> tuple[str, ...]:
    """The CPU's vector extensions that matter to the kernels (empty where unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            words = {w for ln in f if ln.startswith(("flags", "Features")) for w in ln.split(":", 1)[1].split()}
    except (OSError, IndexError):
        return ()
    return tuple(flag for flag in _ISA_FLAGS if flag in words)


class KernelReport(NamedTuple):
    kernels: dict[str, KernelState]  # by library name: paged_decode_attention, packed_gemm, ...
    cpu_features: tuple[str, ...]
    variant: str = ""  # the instruction-set variant chosen (kernels/isa.py); "" when none can run
    variant_reason: str = ""  # "chosen from the CPU's features", "forced by PAGEDLLM_KERNEL_MARCH=..."

    @property
    def active_names(self) -> list[str]:
        return [name for name, state in self.kernels.items() if state.active]

    @property
    def any_active(self) -> bool:
        return bool(self.active_names)

    @property
    def path(self) -> str:
        """`c` (every kernel active), `torch` (none) or `mixed`."""
        active = len(self.active_names)
        return "c" if active == len(self.kernels) else "torch" if active == 0 else "mixed"

    def summary(self) -> str:
        """One line: what runs, and why a kernel does not."""
        off = {name: state.reason for name, state in self.kernels.items() if not state.active}
        reasons = sorted(set(off.values()))
        if not self.any_active:
            why = reasons[0] if len(reasons) == 1 else "; ".join(f"{n}: {r}" for n, r in off.items())
            return f"C kernels: none active, the plain torch path runs (slower): {why}"
        line = f"C kernels active ({self.variant} variant, {self.variant_reason}): {', '.join(self.active_names)}"
        if off:
            line += "; on the torch path: " + "; ".join(f"{n} ({r})" for n, r in off.items())
        return line

    def describe(self) -> str:
        """Several lines, for `pagedllm --version`."""
        lines = [self.summary()]
        for name, state in self.kernels.items():
            lines.append(f"  {name}: {'active' if state.active else 'off'} ({state.reason})")
        lines.append(f"CPU features: {' '.join(self.cpu_features) or 'unknown'} ({platform.machine()})")
        lines.append(f"kernel variant: {self.variant or 'none'} ({self.variant_reason})")
        isa = int_gemm_isa_name()
        if isa is not None:
            lines.append(f"int_gemm instruction set: {isa}")
        return "\n".join(lines)

    def info_labels(self) -> dict[str, str]:
        """The labels of the `pagedllm:kernel_info` metric."""
        off = [name for name, state in self.kernels.items() if not state.active]
        return {
            "path": self.path,
            "kernels": ",".join(self.active_names),
            "inactive": ",".join(off),
            "cpu_features": ",".join(self.cpu_features),
            "variant": self.variant,
        }


def kernel_status() -> KernelReport:
    """Build or load every kernel library not tried yet, and report each."""
    choice = select_variant()
    return KernelReport({src[:-2]: kernel_state(src) for src in kernel_sources()}, cpu_features(),
                        choice.variant.name if choice.variant is not None else "", choice.how)


def log_kernel_status(device: object = "cpu") -> None:
    """The start-up line (on CPU; other devices do not use these kernels)."""
    if str(device).split(":")[0] != "cpu":
        logger.info("C kernels: not used on %s", device)
        return
    report = kernel_status()
    features = " ".join(report.cpu_features) or "unknown"
    isa = int_gemm_isa_name()
    logger.info("%s (CPU features: %s%s)", report.summary(), features, f"; int_gemm: {isa}" if isa else "")


def int_gemm_isa_name() -> str | None:
    """The instruction set int_gemm.c was built for here (None: not active)."""
    from pagedllm.quantization.kernels.int_kernel import int_gemm_isa  # lazy: imports torch

    return int_gemm_isa()


__all__ = ["DISABLE_ENV", "KernelReport", "cpu_features", "kernel_status", "log_kernel_status"]

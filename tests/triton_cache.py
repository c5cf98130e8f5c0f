"""Where the GPU compile checks (tests/unit/test_triton_*.py: Triton kernels compiled for sm_80 /
sm_90 on a machine without a GPU, register spills read from the result) keep Triton's cache:
under the pagedllm cache folder, like the C kernels. Triton keys each entry by the kernel's
source, its constants and options, the target and Triton's own version, so a compile runs again
whenever any of those changes, and only then (a fresh machine compiles everything once)."""

from __future__ import annotations

from pathlib import Path


def triton_compile_cache() -> Path:
    from pagedllm.model_source import cache_dir

    return cache_dir() / "triton-compile-checks"

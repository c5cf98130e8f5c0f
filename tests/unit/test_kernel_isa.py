"""Instruction-set variants of the C kernels (kernels/isa.py, kernels/build.py): which variant a
CPU gets, forcing one, refusing one the CPU cannot run, cache keys that do not depend on the
machine that built a library; and every variant this CPU runs builds and computes correct
products (the speeds are benchmarks/kernel_matrix.py's, not the suite's)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch

from pagedllm.kernels import build as kernel_build
from pagedllm.kernels import isa

X86 = platform.machine().lower() in ("x86_64", "amd64")
HAVE_GCC = shutil.which("gcc") is not None or shutil.which("cc") is not None
needs_x86 = pytest.mark.skipif(not X86, reason="the variants listed are x86-64 ones")
V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.fixture(autouse=True)
def _no_forcing(monkeypatch):
    monkeypatch.delenv(isa.MARCH_ENV, raising=False)
    # another test may have left a compiler marked broken (tests of a missing CC): not ours
    monkeypatch.setattr(kernel_build, "_broken_compiler", None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv(kernel_build.DISABLE_ENV, raising=False)


@needs_x86
@pytest.mark.parametrize("flags,expected", [
    (V4 | {"avx512_vnni", "avx512_bf16", "avx_vnni"}, "avx512-vnni-bf16"),  # Zen4 / Zen5
    (V4 | {"avx512_vnni"}, "avx512-vnni"),  # Ice Lake server
    (V4, "avx512"),  # Skylake-SP
    (V3 | {"avx_vnni"}, "avx2-vnni"),  # Alder Lake
    (V3, "avx2"),  # Zen3, Haswell
    (V3 - {"fma"}, "portable"),  # AVX2 without FMA is not x86-64-v3
    ({"sse2", "sse4_2"}, "portable"),
    (frozenset(), "portable"),  # /proc/cpuinfo unreadable
])
def test_variant_from_the_cpus_features(flags, expected):
    choice = isa.select_variant(frozenset(flags))
    assert choice.variant.name == expected
    assert "CPU's features" in choice.how


@needs_x86
@pytest.mark.parametrize("forced,expected", [("avx2", "avx2"), ("x86-64-v3", "avx2"), ("x86-64", "portable"),
                                             ("x86-64-v4", "avx512"), ("native", "native")])
def test_forcing_a_variant_by_name_or_march_level(monkeypatch, forced, expected):
    monkeypatch.setenv(isa.MARCH_ENV, forced)
    choice = isa.select_variant(frozenset(V4 | {"avx512_vnni", "avx512_bf16", "avx_vnni"}))
    assert choice.variant.name == expected and isa.MARCH_ENV in choice.how


@needs_x86
def test_forced_variant_this_cpu_cannot_run_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(isa.MARCH_ENV, "avx512-vnni")
    choice = isa.select_variant(frozenset(V3))
    assert choice.variant is None
    assert "avx512_vnni" in choice.how and "avx512f" in choice.how and isa.MARCH_ENV in choice.how


@needs_x86
def test_forced_variant_the_cpu_lacks_leaves_the_kernels_off(monkeypatch, tmp_path):
    monkeypatch.setattr(kernel_build, "_loaded", {})
    monkeypatch.setattr(kernel_build, "_status", {})
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset(V3))
    monkeypatch.setenv(isa.MARCH_ENV, "avx512")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    assert kernel_build.build_library("fused_ops.c") is None
    state = kernel_build.kernel_state("fused_ops.c")
    assert not state.active and "lacks" in state.reason
    assert not list(tmp_path.rglob("*.so"))  # nothing was built for it


def test_an_unknown_march_is_built_as_given_and_keyed_by_the_cpu(monkeypatch):
    monkeypatch.setenv(isa.MARCH_ENV, "znver3")
    choice = isa.select_variant(frozenset())
    assert choice.variant.flags == ("-march=znver3",) and choice.variant.per_cpu


@needs_x86
def test_named_variants_are_not_keyed_by_the_cpu(monkeypatch, tmp_path):
    """A library built for `avx2` on one machine is the one another AVX2 machine loads."""
    if not HAVE_GCC:
        pytest.skip("no C compiler")
    monkeypatch.setattr(kernel_build, "_loaded", {})
    monkeypatch.setattr(kernel_build, "_status", {})
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    if "avx2" not in [v.name for v in isa.runnable_variants()]:
        pytest.skip("this CPU cannot run AVX2 code")
    assert kernel_build.build_library("fused_ops.c", "avx2") is not None
    (lib,) = tmp_path.rglob("fused_ops-avx2-*.so")
    monkeypatch.setattr(kernel_build, "_loaded", {})
    monkeypatch.setattr(kernel_build, "_cpu_signature", lambda: "another machine entirely")
    assert kernel_build.build_library("fused_ops.c", "avx2") is not None
    assert list(tmp_path.rglob("fused_ops-avx2-*.so")) == [lib]  # reused, not rebuilt


def test_unknown_variant_name_is_reported():
    assert kernel_build.packed_gemm_kernel("no-such-isa") is None
    assert "unknown kernel variant" in kernel_build.kernel_state("packed_gemm.c", "no-such-isa").reason


# ---- every variant this CPU runs: builds and is correct ---------------------------------------


def _runnable() -> list[str]:
    return [v.name for v in isa.runnable_variants()] if HAVE_GCC else []


def _packed_product(kernel, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    m = x.shape[0]
    packed = torch.empty(kernel.packed_size(n, k), dtype=torch.float32)
    kernel.pack(w.data_ptr(), packed.data_ptr(), n, k)
    out = torch.empty(m, n)
    scratch = torch.empty(min(m, 144) * k)
    assert kernel.gemm(x.data_ptr(), packed.data_ptr(), out.data_ptr(), scratch.data_ptr(), m, n, k, 2) == 0
    return out


@pytest.mark.slow  # builds three libraries per variant (about 5 s each on 2 cores; the kernel cache: scripts/test.sh)
@pytest.mark.parametrize("variant", _runnable())
def test_every_variant_multiplies_correctly(variant):
    """packed_gemm.c, int_gemm.c and gguf_gemm.c of this variant, through their C entry points, against
    torch: tile edges in every direction (rows 1-3 narrow, 5-7 partial tiles, 17+ the panel
    path, 150 two row chunks; 45 and 100 columns partial panels)."""
    pg = kernel_build.packed_gemm_kernel(variant)
    ig = kernel_build.int_gemm_kernel(variant)
    assert pg is not None and ig is not None, kernel_build.kernel_state("int_gemm.c", variant).reason
    g = torch.Generator().manual_seed(0)
    for n, k in [(45, 64), (100, 96), (576, 576)]:
        w = torch.randn(n, k, generator=g)
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
        d = torch.rand(n, k // 32, generator=g) * 0.01 + 0.001
        mins = torch.randn(n, k // 32, generator=g) * 0.05
        packed = torch.empty(ig.packed_size(4, 1, n, k, 32), dtype=torch.uint8)
        assert ig.pack(4, 1, codes.data_ptr(), d.data_ptr(), mins.data_ptr(), packed.data_ptr(), n, k, 32) == 0
        wq = (codes.float().view(n, k // 32, 32) * d.unsqueeze(-1) + mins.unsqueeze(-1)).view(n, k)
        for m in (1, 2, 3, 5, 7, 17, 150):
            x = torch.randn(m, k, generator=g)
            torch.testing.assert_close(_packed_product(pg, x, w), x @ w.T, rtol=1e-4, atol=1e-4)
            out = torch.empty(m, n)
            scratch = torch.empty(min(m, 144) * k)
            assert ig.exact(4, 1, x.data_ptr(), packed.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                            m, n, k, 32, 2) == 0
            torch.testing.assert_close(out, x @ wq.T, rtol=1e-4, atol=1e-4)
            s8 = torch.empty(ig.int8_scratch(m, k), dtype=torch.uint8)
            assert ig.int8(4, 1, x.data_ptr(), packed.data_ptr(), out.data_ptr(), s8.data_ptr(),
                           m, n, k, 32, 2) == 0
            ref = x @ wq.T
            assert (out - ref).norm() / ref.norm() < 1e-2  # int8 activations: within 1%
    _check_gguf_kquants(variant, g)


def _check_gguf_kquants(variant: str, g: torch.Generator) -> None:
    """gguf_gemm.c's exact path for Q4_K, Q6_K, Q5_0 and Q8_0 (scales factored out of the sum under AVX2
    and AVX-512, lanes in the codes' own order: each ISA's lane width reorders differently) against
    gguf-py's dequantization: 1-4 rows (specialized), 5-16, and two chunks of 16."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize

    from pagedllm.quantization.kernels.gguf_kernel import TYPES
    from tests.gguf_random import random_tensor

    gk = kernel_build.gguf_gemm_kernel(variant)
    assert gk is not None, kernel_build.kernel_state("gguf_gemm.c", variant).reason
    for type_name in ("Q4_K", "Q6_K", "Q5_0", "Q8_0"):
        n, k = 37, 1024
        raw = torch.from_numpy(np.ascontiguousarray(random_tensor(type_name, n, k, seed=1)).view(np.uint8).reshape(n, -1))
        w = torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType[type_name]).reshape(n, k).astype(np.float64))
        for m in (1, 2, 4, 5, 16, 33):
            x = torch.randn(m, k, generator=g)
            out = torch.empty(m, n)
            scratch = torch.empty(m * k * 4 + 64, dtype=torch.uint8)
            assert gk.exact(TYPES[type_name], x.data_ptr(), raw.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                            m, n, k, n, 2) == 0
            ref = x.double() @ w.T
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


_ATTENTION_CHILD = r"""
import json, sys, torch
sys.path.insert(0, "tests/unit")
from pagedllm.kernels.build import kernel_state
import test_prefill_attention_kernel as pf  # its cases and float64 reference
from pagedllm.layers.backends.decode_op import decode_attention_c, decode_attention_torch
worst = 0.0
g = torch.Generator().manual_seed(0)
for seqs, hq, hk in [(3, 9, 3), (20, 8, 2), (5, 4, 4)]:
    kc = torch.randn(96, 16, hk, 64, generator=g); vc = torch.randn(96, 16, hk, 64, generator=g)
    tables = torch.randperm(96, generator=g)[: seqs * 4].view(seqs, 4)
    lens = torch.randint(1, 64, (seqs,), generator=g)
    q = torch.randn(seqs, hq, 64, generator=g)
    got = decode_attention_c(q, kc, vc, tables, lens, 0.125, None)
    worst = max(worst, float((got - decode_attention_torch(q, kc, vc, tables, lens, 0.125, None)).abs().max()))
for case in pf.CASES:
    seqs, hq, hk, dh, bs, window = case
    q, k, v, kc, vc, md = pf._case(seqs, hq, hk, dh, bs)
    want, _, _ = pf._reference(q, k, v, kc, vc, md, dh ** -0.5, window)
    got = pf.prefill_attention_c(q, k, v, kc, vc, md, dh ** -0.5, window)
    worst = max(worst, float((got - want).abs().max()))
# only the two attention libraries (kernel_status() would build every kernel in this variant)
variants = {kernel_state(src).variant for src in ("paged_decode_attention.c", "paged_prefill_attention.c")}
print(json.dumps({"variant": variants.pop() if len(variants) == 1 else sorted(variants), "worst": worst}))
"""


@pytest.mark.slow  # a child process per variant (the kernel cache: scripts/test.sh fills it)
@pytest.mark.skipif(not _runnable(), reason="no compiler: no variant builds")
def test_every_variant_attends_correctly():
    """The decode and prefill attention kernels of every variant this CPU runs (the op reads the
    process's variant, so each runs in a child with PAGEDLLM_KERNEL_MARCH; the children run at
    once) against torch references, from the shared kernel cache."""
    from pagedllm.model_source import cache_dir

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    children = {}
    for variant in _runnable():
        env = dict(os.environ, PAGEDLLM_KERNEL_MARCH=variant, PAGEDLLM_CACHE_DIR=str(cache_dir()))
        children[variant] = subprocess.Popen([sys.executable, "-c", _ATTENTION_CHILD], env=env, cwd=root,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for variant, proc in children.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (variant, err[-3000:])
        result = json.loads(out.strip().splitlines()[-1])
        assert result["variant"] == variant
        assert result["worst"] < 1e-4, (variant, result)


def test_prebuild_builds_every_source_for_every_variant_asked(monkeypatch):
    """`python -m pagedllm.kernels --all-variants` (scripts/test.sh): each source once per variant,
    compilers side by side (not under build_library's lock), every state reported."""
    import threading

    built, inside, most = [], [0], [0]
    lock = threading.Lock()

    def fake_build(source, variant=None):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        threading.Event().wait(0.05)
        with lock:
            inside[0] -= 1
            built.append((source, variant))
        kernel_build._status[kernel_build._key(source, variant)[0]] = kernel_build.KernelState(True, "ok", variant)

    monkeypatch.setattr(kernel_build, "_build", fake_build)
    monkeypatch.setattr(kernel_build, "_status", {})
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset(V3))
    states = kernel_build.prebuild(["portable", "avx2"], jobs=2)
    sources = kernel_build.kernel_sources()
    assert sorted(built) == sorted((s, v) for v in ("portable", "avx2") for s in sources)
    assert len(states) == 2 * len(sources) and all(s.active for s in states.values())
    assert most[0] == 2

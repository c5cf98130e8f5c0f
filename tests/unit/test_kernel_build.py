"""The native boundary, build and load (kernels/build.py): loading a kernel leaves the process's
floating-point mode alone; no build problem takes the engine down (each falls back to torch
with one warning); a cached library someone else could have written is refused; and which
path runs is reported (`kernel_status`, `pagedllm --version`, the `pagedllm:kernel_info`
metric)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from pagedllm.kernels import build as kernel_build
from pagedllm.kernels.status import kernel_status

SOURCES = ["paged_decode_attention.c", "packed_gemm.c", "int_gemm.c", "fused_ops.c"]
HAVE_GCC = shutil.which("gcc") is not None or shutil.which("cc") is not None
needs_compiler = pytest.mark.skipif(not HAVE_GCC, reason="no C compiler")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No library loaded yet in this process, and a private, empty cache."""
    monkeypatch.setattr(kernel_build, "_loaded", {})
    monkeypatch.setattr(kernel_build, "_status", {}, raising=False)
    monkeypatch.setattr(kernel_build, "_broken_compiler", None, raising=False)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(kernel_build.DISABLE_ENV, raising=False)
    return tmp_path


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == kernel_build.__name__ and r.levelno >= logging.WARNING]


def _script(path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


# ---- floating-point mode ------------------------------------------------------------------------


@needs_compiler
@pytest.mark.slow  # seconds (a subprocess / a compile): not in the quick `not slow` run
def test_loading_kernels_keeps_denormals():
    """gcc links crtfastmath.o into a library linked with -ffast-math, and its constructor sets
    flush-to-zero / denormals-are-zero for the whole process (torch, numpy, the user's code).
    The decode kernel sets them for its own work items only, and restores them."""
    script = textwrap.dedent(f"""
        import json
        import numpy as np
        import torch
        def denormals_survive():
            return {{
                "python": 1e-310 * 1.0 != 0.0,
                "torch_f64": float(torch.tensor(1e-310, dtype=torch.float64) * 1) != 0.0,
                "torch_f32": float(torch.tensor(1e-40) * 1) != 0.0,
                "numpy_f32": float(np.float32(1e-40) * np.float32(1)) != 0.0,
                # on every thread of torch's pool, which the kernels share
                "torch_f32_threads": bool((torch.full((1 << 20,), 1e-40) * 1 != 0).all()),
            }}
        before = denormals_survive()
        from pagedllm.kernels import build
        import pathlib
        sources = sorted(p.name for p in pathlib.Path(build.__file__).parent.glob("*.c"))
        loaded = {{s: build.build_library(s) is not None for s in sources}}
        # and after running one: a kernel may set the mode for its own work, never leave it set
        from pagedllm.layers.backends.decode_op import decode_attention_c
        kc = torch.randn(8, 16, 2, 64)
        decode_attention_c(torch.randn(4, 4, 64) * 30, kc, kc.clone(), torch.arange(8).view(4, 2),
                           torch.full((4,), 32), 1.0, None)
        print(json.dumps({{"before": before, "after": denormals_survive(), "loaded": loaded}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != kernel_build.DISABLE_ENV}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(result["loaded"].values()), result
    assert all(result["before"].values()), result
    assert result["after"] == result["before"], f"loading the kernels flushed denormals: {result}"


def test_cache_key_changes_with_the_link_step():
    """Libraries cached by a build that linked crtfastmath.o must not be reused."""
    assert "-ffast-math" not in kernel_build._LDFLAGS and "-Ofast" not in kernel_build._LDFLAGS
    assert kernel_build._BUILD_RECIPE_VERSION >= 2  # in the cache key


# ---- the build never takes the engine down ---------------------------------------------------------


def test_cache_dir_that_is_a_file_falls_back(fresh, monkeypatch, caplog):
    blocker = fresh / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(blocker))
    assert kernel_build.build_library("fused_ops.c") is None
    assert kernel_build.build_library("fused_ops.c") is None
    (warning,) = _warnings(caplog)
    assert "PAGEDLLM_CACHE_DIR" in warning and "torch" in warning


def test_read_only_cache_dir_falls_back(fresh, monkeypatch, caplog):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", "/proc/pagedllm-read-only-cache")  # read-only, even for root
    assert kernel_build.build_library("fused_ops.c") is None
    (warning,) = _warnings(caplog)
    assert "PAGEDLLM_CACHE_DIR" in warning


def test_hanging_compiler_times_out(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", _script(fresh / "cc-hangs", "sleep 30"))
    monkeypatch.setenv("PAGEDLLM_KERNEL_BUILD_TIMEOUT", "1")
    t0 = time.monotonic()
    assert kernel_build.build_library("fused_ops.c") is None
    assert time.monotonic() - t0 < 10
    (warning,) = _warnings(caplog)
    assert "timed out" in warning and "PAGEDLLM_KERNEL_BUILD_TIMEOUT" in warning


def test_hanging_compiler_is_tried_once_for_all_kernels(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", _script(fresh / "cc-hangs", "sleep 30"))
    monkeypatch.setenv("PAGEDLLM_KERNEL_BUILD_TIMEOUT", "1")
    t0 = time.monotonic()
    assert all(kernel_build.build_library(s) is None for s in SOURCES)
    assert time.monotonic() - t0 < 10
    assert len(_warnings(caplog)) == 1
    status = kernel_status()
    assert all(not k.active and "timed out" in k.reason for k in status.kernels.values())


def test_failing_compiler_falls_back_with_one_warning(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", _script(fresh / "cc-fails", "echo 'cc: internal error: boom' >&2; exit 1"))
    for _ in range(3):
        assert kernel_build.build_library("fused_ops.c") is None
    (warning,) = _warnings(caplog)
    assert "boom" in warning and "torch" in warning
    assert not list((fresh / "cache" / "kernels").glob("*.so"))  # no half-written library left


def test_missing_compiler_is_reported(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(fresh / "no-such-cc"))
    status = kernel_status()
    assert not status.any_active
    assert all("compiler" in k.reason for k in status.kernels.values())
    assert len(_warnings(caplog)) == 1


@needs_compiler
@pytest.mark.parametrize("tamper", ["file o+w", "file g+w", "file owner", "dir o+w", "dir owner"])
def test_cached_library_others_could_write_is_refused(fresh, caplog, tamper):
    assert kernel_build.build_library("fused_ops.c") is not None  # builds and caches it
    (lib,) = (fresh / "cache" / "kernels").glob("fused_ops-*.so")
    target = lib.parent if tamper.startswith("dir") else lib
    if tamper.endswith("owner"):
        if os.getuid() != 0:
            pytest.skip("changing a file's owner needs root")
        os.chown(target, os.getuid() + 4242, -1)
    else:
        target.chmod(target.stat().st_mode | (0o002 if "o+w" in tamper else 0o020))
    kernel_build._loaded.clear()
    kernel_build._status.clear()
    caplog.clear()
    assert kernel_build.build_library("fused_ops.c") is None
    (warning,) = _warnings(caplog)
    assert "refus" in warning and str(target) in warning


@needs_compiler
def test_built_library_is_private_to_its_owner(fresh):
    old = os.umask(0o002)  # a umask that would leave the library group-writable
    try:
        assert kernel_build.build_library("fused_ops.c") is not None
    finally:
        os.umask(old)
    (lib,) = (fresh / "cache" / "kernels").glob("fused_ops-*.so")
    for path in (lib, lib.parent):
        assert path.stat().st_uid == os.getuid() and not path.stat().st_mode & 0o022


# ---- which path runs --------------------------------------------------------------------------------


def test_disabled_kernels_are_reported(fresh, monkeypatch):
    monkeypatch.setenv(kernel_build.DISABLE_ENV, "1")
    status = kernel_status()
    assert set(status.kernels) >= {s[:-2] for s in SOURCES}
    assert not status.any_active
    assert all(kernel_build.DISABLE_ENV in k.reason for k in status.kernels.values())
    assert "torch" in status.summary() and kernel_build.DISABLE_ENV in status.summary()
    assert isinstance(status.cpu_features, tuple)


@needs_compiler
@pytest.mark.slow  # seconds (a subprocess / a compile): not in the quick `not slow` run
def test_active_kernels_are_reported(monkeypatch):
    """Every kernel active and named (from the run's kernel cache: building all of them from
    nothing is what the other tests of this file do, per case, with small sources)."""
    monkeypatch.setattr(kernel_build, "_loaded", {})
    monkeypatch.setattr(kernel_build, "_status", {}, raising=False)
    monkeypatch.delenv(kernel_build.DISABLE_ENV, raising=False)
    status = kernel_status()
    assert status.any_active and all(k.active for k in status.kernels.values()), status
    assert all(name in status.summary() for name in status.kernels)


def test_kernel_info_metric(fresh, monkeypatch):
    from prometheus_client.parser import text_string_to_metric_families

    from pagedllm.metrics import EngineMetrics

    monkeypatch.setenv(kernel_build.DISABLE_ENV, "1")
    text = EngineMetrics("m").render().decode()
    (sample,) = [s for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "pagedllm:kernel_info"]
    assert sample.value == 1
    assert sample.labels["model_name"] == "m"
    assert sample.labels["kernels"] == "" and sample.labels["path"] == "torch"
    assert "cpu_features" in sample.labels


def _version(**env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != kernel_build.DISABLE_ENV}
    full.update(env)
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "--version"],
                          capture_output=True, text=True, env=full, timeout=300)


@pytest.mark.slow  # seconds (a subprocess / a compile): not in the quick `not slow` run
def test_version_shows_the_torch_path_when_disabled():
    import pagedllm

    proc = _version(PAGEDLLM_DISABLE_C_KERNELS="1")
    assert proc.returncode == 0, proc.stderr
    assert f"pagedllm {pagedllm.__version__}" in proc.stdout
    assert "torch" in proc.stdout and kernel_build.DISABLE_ENV in proc.stdout


@pytest.mark.slow  # seconds (a subprocess / a compile): not in the quick `not slow` run
def test_version_shows_a_missing_compiler(tmp_path):
    proc = _version(CC=str(tmp_path / "no-such-cc"), PAGEDLLM_CACHE_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "compiler" in proc.stdout and "torch" in proc.stdout


@needs_compiler
@pytest.mark.slow  # seconds (a subprocess / a compile): not in the quick `not slow` run
def test_version_lists_the_active_kernels():
    proc = _version()
    assert proc.returncode == 0, proc.stderr
    for name in ("paged_decode_attention", "packed_gemm", "int_gemm", "fused_ops"):
        assert name in proc.stdout
    assert "CPU features" in proc.stdout

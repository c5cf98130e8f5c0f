"""layers/kernel_choice.py: the faster candidate per batch bucket wins (timings made
deterministic with a slow candidate), the table is cached per machine and reused without
measuring, the time budget bounds the measurement, the modes, and the layers honour a choice."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import kernel_choice as kc


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(kc.MODE_ENV, "measure")
    monkeypatch.setattr(kc, "_table", None)
    monkeypatch.setattr(kc, "_spent_s", 0.0)
    monkeypatch.setattr(kc, "_new_entries", False)
    monkeypatch.setattr(kc, "_used", {})
    monkeypatch.setattr(kc, "_choices", {})
    monkeypatch.setattr(kc, "_noisy", False)
    monkeypatch.setattr(kc, "_watch", kc.CpuWatch())
    monkeypatch.setattr(kc.CpuWatch, "others_share", lambda self: 0.0)  # a quiet machine, whatever runs beside
    return tmp_path


@pytest.fixture
def int4_weight():
    """A packed 4-bit [40, 64] weight in groups of 32, and the generator that made it."""
    from pagedllm.quantization.kernels import int_kernel

    if int_kernel.int_gemm_kernel() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (40, 64), generator=g, dtype=torch.int32).to(torch.uint8)
    return int_kernel.pack_int_weight(codes, torch.rand(40, 2, generator=g), torch.rand(40, 2, generator=g), 4, 32), g


def _slow_when(predicate, seconds=0.003):
    def fn(x):
        if predicate(x.shape[0]):
            time.sleep(seconds)
        return x
    return fn


def test_bucket_index_is_nearest_on_a_log_scale():
    assert [kc.bucket_index(m) for m in (1, 2, 3, 8, 16, 17, 32, 64, 65, 128, 256, 257, 512, 4096)] == \
           [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]


def test_the_faster_candidate_wins_each_bucket(fresh):
    candidates = {"kernel": _slow_when(lambda m: m >= 128), "torch": _slow_when(lambda m: m < 128)}
    paths = kc.choose("t 64x64", candidates, 64, default="kernel", out_features=64)
    assert paths == ("kernel", "kernel", "kernel", "torch", "torch")
    assert kc.used()["t 64x64"] == paths


def test_the_table_is_cached_per_machine_and_reused_without_measuring(fresh, monkeypatch):
    candidates = {"kernel": _slow_when(lambda m: True), "torch": _slow_when(lambda m: False)}
    assert kc.choose("t 8x8", candidates, 8, default="kernel", out_features=8) == ("torch",) * 5
    kc.save()
    (path,) = (fresh / "kernels").glob("choices-*.json")
    assert json.loads(path.read_text())["t 8x8"] == ["torch"] * 5
    monkeypatch.setattr(kc, "_table", None)  # a new process: nothing in memory
    monkeypatch.setattr(kc, "_spent_s", 0.0)
    never = {"kernel": lambda x: pytest.fail("measured again"), "torch": lambda x: pytest.fail("measured again")}
    assert kc.choose("t 8x8", never, 8, default="kernel", out_features=8) == ("torch",) * 5
    assert kc.spent_seconds() == 0.0


def test_a_spent_budget_keeps_the_default_and_caches_nothing(fresh, monkeypatch):
    monkeypatch.setenv(kc.BUDGET_ENV, "0")
    never = {"kernel": lambda x: pytest.fail("measured"), "torch": lambda x: pytest.fail("measured")}
    assert kc.choose("t 4x4", never, 4, default="kernel", out_features=4) == ("kernel",) * 5
    kc.save()
    assert not list(fresh.rglob("choices-*.json"))


def test_buckets_too_costly_to_measure_take_the_bucket_below(fresh):
    seen = []

    def record(x):
        seen.append(x.shape[0])
        return x
    # 2 * m * 4096 * 49152 flops: past 2 GFLOP from 8 rows on
    paths = kc.choose("t huge", {"kernel": record, "torch": _slow_when(lambda m: True)}, 4096,
                      default="kernel", out_features=49152)
    assert set(seen) == {1} and paths == ("kernel",) * 5


@pytest.mark.parametrize("mode,expected", [("kernel", ("kernel",) * 5), ("torch", ("torch",) * 5)])
def test_modes(fresh, monkeypatch, mode, expected):
    monkeypatch.setenv(kc.MODE_ENV, mode)
    never = {"kernel": lambda x: pytest.fail("measured"), "torch": lambda x: pytest.fail("measured")}
    assert kc.choose("t", never, 4, default="kernel", out_features=4) == expected


def test_an_unknown_mode_is_a_value_error(monkeypatch):
    monkeypatch.setenv(kc.MODE_ENV, "fastest")
    with pytest.raises(ValueError, match="PAGEDLLM_KERNEL_CHOICE must be one of"):
        kc.mode()


def test_a_float_layer_runs_torch_where_torch_won(fresh, monkeypatch):
    from pagedllm.layers import linear as linear_mod

    if linear_mod.packed_gemm_kernel() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(kc, "_choose", lambda *a, **k: ("kernel", "torch", "torch", "kernel", "kernel"))
    w = torch.randn(48, 32)
    prepared = linear_mod.prepare_weight(w)
    calls = []
    real = linear_mod._kernel_product
    monkeypatch.setattr(linear_mod, "_kernel_product", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for m in (1, 8, 40, 128):
        x = torch.randn(m, 32)
        torch.testing.assert_close(linear_mod.linear(x, w, prepared=prepared), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert calls == [1, 128]  # 8 and 40 rows went to F.linear


def test_an_int_layer_keeps_no_float_copy_unless_torch_is_asked_for(fresh, monkeypatch, int4_weight):
    from pagedllm.quantization.kernels import int_kernel

    w, _ = int4_weight
    monkeypatch.setattr(int_kernel, "_float_copy_bytes", 0)
    chosen = int_kernel.with_choice(w, "exact")  # measure mode: nothing measured, no copy
    assert chosen.float_weight is None and chosen.paths == ("exact",) * 5
    monkeypatch.setenv(kc.MODE_ENV, "torch")
    chosen = int_kernel.with_choice(w, "exact")
    assert chosen.paths == ("torch",) * 5 and torch.equal(chosen.float_weight, int_kernel.unpack_int_weight(w))


def test_a_candidate_within_the_margin_does_not_displace_the_default(fresh):
    # torch 10% faster at every bucket: not a clear win
    candidates = {"kernel": _slow_when(lambda m: True, 0.0033), "torch": _slow_when(lambda m: True, 0.003)}
    assert kc.choose("t margin", candidates, 8, default="kernel", out_features=8) == ("kernel",) * 5


def test_a_noisy_machine_keeps_the_default_and_caches_nothing(fresh, monkeypatch):
    monkeypatch.setattr(kc.CpuWatch, "others_share", lambda self: 0.6)
    candidates = {"kernel": _slow_when(lambda m: True), "torch": _slow_when(lambda m: False)}
    assert kc.choose("t noisy", candidates, 8, default="kernel", out_features=8) == ("kernel",) * 5
    monkeypatch.setattr(kc.CpuWatch, "others_share", lambda self: 0.0)
    # the rest of this process's measurements are not trusted either
    assert kc.choose("t later", candidates, 8, default="kernel", out_features=8) == ("kernel",) * 5
    kc.save()
    assert not list(fresh.rglob("choices-*.json"))


def test_the_cpu_watch_sees_other_processes_busy(monkeypatch):
    import os
    import subprocess
    import sys

    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    watch = kc.CpuWatch()
    watch.start()
    busy = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 0.8\nwhile time.time() < t: pass"])
            for _ in range(os.cpu_count() or 1)]
    for proc in busy:
        proc.wait()
    assert watch.others_share() > kc.NOISY_SHARE


def test_a_losing_verdict_expires_on_real_calls_and_leaves_the_cache(fresh, monkeypatch):
    candidates = {"kernel": _slow_when(lambda m: m <= 2), "torch": _slow_when(lambda m: m > 2)}
    choice = kc.choose("t expire", candidates, 8, default="kernel", out_features=8)
    assert choice[0] == "torch"
    kc.save()
    monkeypatch.setattr(kc, "RECHECK_EVERY", 2)
    slow, fast = (lambda: time.sleep(0.003)), (lambda: None)
    for _ in range(2 * kc.LOSSES_TO_EXPIRE):  # every second call re-checks: the default wins each time
        if choice.due(0):
            choice.recheck(0, slow, fast)
    assert choice[0] == "kernel"
    (path,) = (fresh / "kernels").glob("choices-*.json")
    assert json.loads(path.read_text())["t expire"][0] == "kernel"


def test_a_float_layer_rechecks_a_torch_bucket_on_real_calls(fresh, monkeypatch):
    from pagedllm.layers import linear as linear_mod

    if linear_mod.packed_gemm_kernel() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(kc, "_choose", lambda *a, **k: ("torch",) * 5)
    monkeypatch.setattr(kc, "RECHECK_EVERY", 3)
    checked = []
    monkeypatch.setattr(kc.Choice, "recheck", lambda self, b, kept, default: checked.append((b, kept(), default())))
    w = torch.randn(48, 32)
    prepared = linear_mod.prepare_weight(w)
    x = torch.randn(1, 32)
    for _ in range(6):
        linear_mod.linear(x, w, prepared=prepared)
    assert [b for b, _, _ in checked] == [0, 0]
    for _, kept, default in checked:  # both paths ran on the real input
        torch.testing.assert_close(kept, default, rtol=1e-5, atol=1e-5)


def test_an_int_layer_keeps_the_float_weight_only_where_torch_won(fresh, monkeypatch, int4_weight):
    from pagedllm.quantization.kernels import int_kernel

    w, g = int4_weight
    monkeypatch.setattr(kc, "_choose", lambda *a, **k: ("exact",) * 5)
    assert int_kernel.with_choice(w, "exact").float_weight is None  # no copy when the kernel wins
    monkeypatch.setenv(kc.MODE_ENV, "torch")  # the only mode that makes float copies of quantized weights
    monkeypatch.setattr(kc, "_choose", lambda *a, **k: ("exact", "exact", "torch", "torch", "torch"))
    chosen = int_kernel.with_choice(w, "exact")
    assert torch.equal(chosen.float_weight, int_kernel.unpack_int_weight(w))
    monkeypatch.setattr(int_kernel, "_int_matmul", lambda *a: pytest.fail("kernel used for 40 rows"))
    x = torch.randn(40, 64, generator=g)
    torch.testing.assert_close(int_kernel.int_linear(x, chosen, "exact"), F.linear(x, chosen.float_weight))


@pytest.mark.parametrize("budget", ["abc", "nan", "-1", "inf"])
def test_a_bad_budget_is_a_value_error_naming_it(fresh, monkeypatch, budget):
    monkeypatch.setenv(kc.BUDGET_ENV, budget)
    with pytest.raises(ValueError, match="PAGEDLLM_KERNEL_CHOICE_BUDGET must be a number of seconds"):
        kc.choose("t bad", {"kernel": lambda x: x, "torch": lambda x: x}, 4, default="kernel", out_features=4)

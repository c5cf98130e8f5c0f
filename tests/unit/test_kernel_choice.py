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
    return tmp_path


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


def test_an_int_layer_keeps_the_float_weight_only_where_torch_won(fresh, monkeypatch):
    from pagedllm.layers.quantization import int_kernel

    if int_kernel.int_gemm_kernel() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (40, 64), generator=g, dtype=torch.int32).to(torch.uint8)
    w = int_kernel.pack_int_weight(codes, torch.rand(40, 2, generator=g), torch.rand(40, 2, generator=g), 4, 32)
    monkeypatch.setattr(kc, "_choose", lambda *a, **k: ("exact",) * 5)
    assert int_kernel.with_choice(w, "exact").float_weight is None  # no copy when the kernel wins
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

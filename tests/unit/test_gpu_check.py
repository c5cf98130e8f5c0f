"""The device check's own logic (benchmarks/gpu_check.py), which runs unwatched on a lent GPU: the
first-divergence statistics, the time-boxed batch loop, the engine loop's abort path, the table
rendering of failed stages, the ShareGPT-like lengths, and SmolLM2's config as written there."""

from __future__ import annotations

import statistics
import time

import pytest

from benchmarks import gpu_check as gc
from benchmarks.workloads import BenchRequest, load_workload, sharegpt_like_requests


def test_first_divergence():
    assert gc.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert gc.first_divergence([1, 2, 3], [9, 2, 3]) == 0
    assert gc.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert gc.first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped early (EOS): differs at its end
    assert gc.first_divergence([], []) is None


def test_divergence_summary_is_over_the_diverged_prompts():
    s = gc.divergence_summary([None, 5, 1, None, 9])
    assert s["num_prompts"] == 5 and s["num_equal"] == 2
    assert s["median_first_divergence"] == 5 and s["min_first_divergence"] == 1
    assert s["per_prompt"] == ["equal", 5, 1, "equal", 9]
    none = gc.divergence_summary([None, None])
    assert none["median_first_divergence"] is None and none["min_first_divergence"] is None


def test_cut_at_eos_keeps_the_eos():
    assert gc.cut_at_eos([4, 2, 2, 2], {2}) == [4, 2]
    assert gc.cut_at_eos([4, 5], {2}) == [4, 5]


def _reqs(n: int, max_tokens: int) -> list[BenchRequest]:
    return [BenchRequest([100] * 4, max_tokens) for _ in range(n)]


def test_run_batches_stops_before_a_batch_that_would_not_fit():
    calls = []

    def generate(batch):
        calls.append(len(batch))
        time.sleep(0.002 * max(r.max_tokens for r in batch))  # 2 ms a step: 40 ms a batch

    res = gc.run_batches(generate, _reqs(10, 20), 2, budget_s=0.1, hard_left_s=10.0, rate=gc.StepRate())
    assert not res["complete"] and 1 <= res["ran_requests"] < 10
    assert res["ran_requests"] == sum(calls) and res["output_tokens"] == 20 * res["ran_requests"]
    assert res["elapsed_s"] < 0.1 + 0.02  # it never started a batch it expected to overrun


def test_run_batches_first_batch_needs_only_the_stage_time():
    rate = gc.StepRate(seconds=1.0, steps=10)  # 0.1 s a step: a 20-step batch is estimated at 2 s
    ran = gc.run_batches(lambda b: None, _reqs(4, 20), 2, budget_s=0.5, hard_left_s=5.0, rate=rate)
    assert ran["ran_requests"] >= 2  # over its share, within what the stage has left
    skipped = gc.run_batches(lambda b: None, _reqs(4, 20), 2, budget_s=0.5, hard_left_s=1.0,
                             rate=gc.StepRate(seconds=1.0, steps=10))
    assert skipped["ran_requests"] == 0 and skipped["output_tokens_per_s"] is None


def test_time_shares_pass_unused_time_on():
    ctx = gc.Ctx(gc.SMOKE, work=None, deadline=time.perf_counter() + 103.0)  # 100 s after the reserve
    limit = gc._time_shares(ctx, {"a": 1.0, "b": 1.0, "c": 2.0})
    assert limit("a") == pytest.approx(25.0, abs=0.5)
    assert limit("b") == pytest.approx(100.0 / 3, abs=0.5)  # "a" took no time: b and c share 100 s


def test_drive_aborts_at_its_time_limit(tmp_path):
    """The engine loop's time-out path: marked incomplete, nothing left in the engine."""
    cfg = dict(gc.TINY_CONFIG, num_hidden_layers=1)
    path = tmp_path / "tiny"
    gc.save_random_llama(cfg, path, "float32", "cpu", seed=0)
    from pagedllm import LLM

    llm = LLM(str(path), device="cpu", kv_cache_space=0.05, swap_space=0.0, max_model_len=256)
    reqs = [BenchRequest([100 + i] * 8, 200) for i in range(3)]
    res = gc.drive(llm, reqs, limit_s=0.0, tag="t")
    assert res["complete"] is False and res["finished"] == 0
    assert not llm.llm_engine.has_unfinished_requests()
    done = gc.drive(llm, [BenchRequest([7] * 8, 5)], limit_s=60.0, tag="u")
    assert done["complete"] and done["output_tokens"] == 5 and "error" not in done


def test_markdown_renders_failed_timed_out_and_skipped_stages():
    report = {
        "mode": "full", "device": "cuda", "deadline_s": 450, "elapsed_s": 451.0, "env": {"packages": {}},
        "stages": {
            "models": {"status": "failed", "traceback": "Traceback ...\nRuntimeError: no GPU", "wall_s": 2.0},
            "tests_triton": {"status": "timeout", "summary": None, "note": "killed at its budget of 110 s"},
            "parity_float32": {"status": "partial", "errors": ["pagedllm"],
                               "pagedllm": {"error": "Traceback\nValueError: boom"}},
            "throughput_eager": {"status": "partial", "seed20": {"error": "Traceback\nOSError: x"},
                                 "sharegpt1000": {"complete": False, "finished": 10, "requests": 1000,
                                                  "output_tokens_per_s": 5.0},
                                 "decode": {"error": "Traceback\nRuntimeError: y"}},
            "throughput_hf": {"status": "ok", "batch_size": 64,
                              "sharegpt1000": {"complete": False, "ran_requests": 128, "requests": 1000,
                                               "output_tokens_per_s": 2.5}},
            "oom": {"status": "ok", "too_small_for_weights": {"raised": "ValueError", "message": "a | b"},
                    "max_model_len_too_large": {"raised": None, "started_with": {"num_blocks": 3},
                                                "request_of_max_model_len": {"raised": "ValueError"}}},
            "kv_blocks_0.5": {"status": "skipped", "note": "deadline"},
        },
    }
    md = gc.render_markdown(report)
    assert "could not render" not in md
    assert "RuntimeError: no GPU" in md and "ValueError: boom" in md
    assert "ran on 128 of 1000 requests" in md and "ran on 10 of 1000 requests" in md
    assert "| kv_blocks_0.5 | skipped |" in md
    assert "a / b" in md  # a message's "|" does not break the table


def test_sharegpt_like_lengths():
    reqs = sharegpt_like_requests(1000, 32000, seed=0)
    assert reqs == load_workload("sharegpt1000", 32000, seed=0)
    assert reqs != sharegpt_like_requests(1000, 32000, seed=1)
    plens = [len(r.prompt_token_ids) for r in reqs]
    olens = [r.max_tokens for r in reqs]
    assert min(plens) >= 4 and max(plens) <= 1024 and min(olens) >= 4
    assert all(p + o <= 2048 for p, o in zip(plens, olens))
    assert all(100 <= t < 32000 for r in reqs[:50] for t in r.prompt_token_ids)
    # long-tailed as ShareGPT: the mean well above the median, means near 161 / 338 before the filter
    assert statistics.mean(olens) > 1.2 * statistics.median(olens)
    assert 120 < statistics.mean(plens) < 170 and 270 < statistics.mean(olens) < 340


def test_smollm2_config_matches_the_default_model():
    """The random stand-in must be SmolLM2's architecture: checked against the default GGUF's own
    config where that file is in the cache (it is never downloaded here)."""
    from pagedllm.model_source import DEFAULT_MODEL_FILE, cache_dir, load_hf_config, resolve_model

    if not (cache_dir() / DEFAULT_MODEL_FILE).exists():
        pytest.skip("the default SmolLM2 GGUF is not in the cache")
    cfg = load_hf_config(resolve_model(None))
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    for key, value in gc.SMOLLM2_CONFIG.items():
        got = theta if key == "rope_theta" else getattr(cfg, key)
        assert got == pytest.approx(value) if isinstance(value, float) else got == value, key

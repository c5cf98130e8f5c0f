"""Smoke test of benchmarks/memory.py on a tiny workload (the real run is in the README)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

TINY = ["--workload", "tiny", "--pool-blocks", "128", "--budget-blocks", "4",
        "--sample-max-tokens", "20", "--beam-width", "3", "--beam-max-tokens", "20",
        "--prefix-requests", "4", "--system-len", "64", "--question-len", "8",
        "--prefix-max-tokens", "4"]


def test_memory_benchmark_tiny(smollm2_gguf, tmp_path, capsys):
    from benchmarks import memory

    out = tmp_path / "memory.json"
    rows = memory.main(TINY + ["--model", smollm2_gguf, "--json-out", str(out)])
    waste, conc, n4, n8, beam, prefix = rows
    # Tiny requests (8-16 + 4-8 tokens) waste much of one block each; still far from 2048.
    assert 0 < waste["paged_waste"] < waste["reserve_max_model_len_waste"] < 1
    # 4 blocks of 16 (64 tokens): no 2048-token reservation fits; the paged pool runs them all.
    assert conc["reserve_max_model_len"] == 0 and conc["paged_peak"] == 4
    assert conc["num_preemptions"] > 0
    # Prompts shorter than a block: the samples copy their only prompt block on the first
    # write, so at the peak they share nothing; beams share the blocks of common ancestors.
    assert n4["ratio"] == 1.0 == n8["ratio"]
    assert beam["shared_peak_blocks"] < beam["independent_peak_blocks"]
    assert prefix["outputs_identical"]
    assert prefix["prefix_served_from_cache"] == 3 / 4  # the first request computes it
    assert prefix["prefill_tokens_on"] == 4 * 72 - 3 * 64 and prefix["prefill_tokens_off"] == 4 * 72
    saved = json.loads(out.read_text())
    assert len(saved["rows"]) == 6 and saved["args"]["workload"] == "tiny"
    assert "| 5 | prefix caching" in capsys.readouterr().out

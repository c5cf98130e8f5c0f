"""The CPU KV cache's memory: zeroed, and on transparent huge pages where Linux offers them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pagedllm.worker.cache_engine import CacheEngine, _zeros_on_huge_pages

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kb() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", text).group(1))


def test_cache_is_zeroed_with_the_right_shape():
    engine = CacheEngine(num_layers=2, num_kv_heads=3, head_dim=8, num_blocks=5, block_size=4, dtype=torch.float32, device="cpu")
    assert len(engine.kv_caches) == 2
    for cache in engine.kv_caches:
        assert cache.shape == (2, 5, 4, 3, 8) and cache.dtype == torch.float32
        assert not cache.any()


@pytest.mark.skipif(not _THP.exists() or "[never]" in _THP.read_text() or not Path("/proc/self/smaps_rollup").exists(),
                    reason="no transparent huge pages here")  # fmt: skip
def test_large_cache_lands_on_huge_pages():
    before = _anon_huge_kb()
    t = _zeros_on_huge_pages((64, 1024, 1024), torch.float32, torch.device("cpu"))  # 256 MB
    gained_mb = (_anon_huge_kb() - before) / 1024
    assert not t.any()
    assert gained_mb >= 128, f"only {gained_mb:.0f} MB of the 256 MB cache is on huge pages"

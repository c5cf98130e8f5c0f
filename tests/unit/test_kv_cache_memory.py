"""The CPU KV cache's memory: zeroed, untouched until used (no start-up cost, RSS what requests
use), and on transparent huge pages where Linux offers them."""

from __future__ import annotations

import ctypes
import mmap
import re
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.worker.cache_engine import CacheEngine, _zeros_on_huge_pages

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags_of(t: torch.Tensor) -> set[str]:
    """The VmFlags of every mapping that holds part of `t`'s memory (from /proc/self/smaps)."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    flags: set[str] = set()
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) < hi and int(head.group(2), 16) > lo
        elif inside and line.startswith("VmFlags:"):
            flags.update(line.split()[1:])
    return flags


def _resident_kb_of(t: torch.Tensor) -> int:
    """Resident kB of exactly `t`'s pages (mincore(2)).

    Not the smaps Rss of the mappings that hold `t`: Linux merges adjacent anonymous mappings with
    the same flags into one, so a new cache mapped beside a shared engine's touched cache reported
    that cache's pages (232 MB on CI)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    lo = t.data_ptr() // page * page
    hi = t.data_ptr() + t.numel() * t.element_size()
    pages = (hi - lo + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * page // 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore residency read on Linux")
def test_a_new_cache_is_not_touched_until_used():
    """A 256 MB-a-layer cache costs no page faults at start-up: its pages arrive as blocks are
    written (torch.zeros wrote every byte: seconds of faults before the first request)."""
    engine = CacheEngine(num_layers=2, num_kv_heads=4, head_dim=64, num_blocks=8192, block_size=16,
                         dtype=torch.float32, device="cpu")
    cache = engine.kv_caches[0]
    assert cache.numel() * 4 == 2 * 8192 * 16 * 4 * 64 * 4  # 256 MiB
    assert _resident_kb_of(cache) < 8 * 1024  # nothing resident but what a huge page or two may hold
    cache[0, 5].fill_(1.0)  # a block written: its pages (only) become resident
    assert 0 < _resident_kb_of(cache) < 16 * 1024
    assert float(cache[0, 5].sum()) == 16 * 4 * 64 and not cache[1].any()


def test_cache_is_zeroed_with_the_right_shape():
    engine = CacheEngine(num_layers=2, num_kv_heads=3, head_dim=8, num_blocks=5, block_size=4, dtype=torch.float32, device="cpu")
    assert len(engine.kv_caches) == 2
    for cache in engine.kv_caches:
        assert cache.shape == (2, 5, 4, 3, 8) and cache.dtype == torch.float32
        assert not cache.any()


@pytest.mark.skipif(not _THP.exists() or "[never]" in _THP.read_text() or not Path("/proc/self/smaps").exists(),
                    reason="no transparent huge pages here")  # fmt: skip
@pytest.mark.slow  # seconds (a subprocess / a compile): not in the quick `not slow` run
def test_large_cache_is_advised_onto_huge_pages():
    """The cache's memory carries the huge-page advice (smaps flag `hg`) before it is touched;
    whether the kernel then finds free 2 MB pages depends on the machine's fragmentation."""
    t = _zeros_on_huge_pages((64, 1024, 1024), torch.float32, torch.device("cpu"))  # 256 MB
    assert not t.any()
    assert "hg" in _vm_flags_of(t)
    # Control: a fresh anonymous mapping carries no advice. (Not `torch.zeros`: in a long test
    # process the allocator may hand back memory an earlier cache advised; seen on CI.)
    fresh = mmap.mmap(-1, 256 << 20)
    plain = torch.frombuffer(fresh, dtype=torch.float32)
    assert "hg" not in _vm_flags_of(plain)
    del plain
    fresh.close()

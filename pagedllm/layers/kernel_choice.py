"""Keep the faster of pagedllm's C kernel and torch's own op, per shape and batch size, on the
machine the engine runs on.

Why: a hand kernel tuned on one CPU can lose to torch's (MKL / oneDNN) op on another, and the
relation flips with the batch size; a fixed rule made on the developers' machines cannot know.
So when a layer's weight is prepared, each candidate (the C kernel's path(s), and `F.linear` on
the float32 weight) runs once per batch bucket (1, 8, 32, 128, 512 rows) on that layer's shape,
and the layer keeps, per bucket, the fastest one; a call with M rows uses the bucket nearest M
(log scale). Layers of one shape share one measurement, and the table is cached per machine in
the kernel cache folder (`choices-<key>.json`, keyed by the CPU, the kernel variant, the kernel
sources, torch's version and the thread count), so a later start measures nothing.

Cost: at most `PAGEDLLM_KERNEL_CHOICE_BUDGET` seconds (default 1.0) of measurement per process;
shapes left when it is spent keep the C kernel, and are not cached (a later start measures
them). `PAGEDLLM_KERNEL_CHOICE`: `measure` (default), `kernel` (always the C kernels, the old
behaviour), `torch` (always torch's op; A/B runs).

Exactness is unchanged by the choice: every candidate multiplies the same float32 weights
(`exact` and `torch` differ only in summation order); `int8` is a candidate only where the
user's `quant_compute` already asked for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MODE_ENV = "PAGEDLLM_KERNEL_CHOICE"
BUDGET_ENV = "PAGEDLLM_KERNEL_CHOICE_BUDGET"
MODES = ("measure", "kernel", "torch")
BUCKETS = (1, 8, 32, 128, 512)
_lock = threading.Lock()
_table: dict[str, tuple[str, ...]] | None = None  # shape key -> winner per bucket (this machine)
_spent_s = 0.0
_new_entries = False


def mode() -> str:
    value = os.environ.get(MODE_ENV, "measure").strip() or "measure"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV} must be one of {list(MODES)}, got {value!r}")
    return value


def _budget_s() -> float:
    raw = os.environ.get(BUDGET_ENV, "1.0")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{BUDGET_ENV} must be a number of seconds >= 0, got {raw!r}")
    return value


def bucket_index(m: int) -> int:
    """The bucket nearest `m` rows on a log scale (1 -> 0, 8 -> 1, 32 -> 2, 128 -> 3, 512+ -> 4)."""
    if m <= 2:
        return 0
    if m <= 16:
        return 1
    if m <= 64:
        return 2
    if m <= 256:
        return 3
    return 4


def _cache_path() -> Path:
    from pagedllm.kernels.build import _SOURCE_DIR, _cpu_signature
    from pagedllm.kernels.isa import select_variant
    from pagedllm.model_source import cache_dir

    variant = select_variant().variant
    h = hashlib.sha256()
    for part in (_cpu_signature(), getattr(variant, "name", "none"), torch.__version__,
                 str(torch.get_num_threads()), repr(BUCKETS)):
        h.update(part.encode() + b"\0")
    for src in sorted(_SOURCE_DIR.glob("*.[ch]")):
        h.update(src.read_bytes())
    return cache_dir() / "kernels" / f"choices-{h.hexdigest()[:16]}.json"


def _load() -> dict[str, tuple[str, ...]]:
    global _table
    if _table is None:
        _table = {}
        try:
            raw = json.loads(_cache_path().read_text())
            _table = {k: tuple(v) for k, v in raw.items() if isinstance(v, list) and len(v) == len(BUCKETS)}
        except (OSError, ValueError):
            pass
    return _table


def save() -> None:
    """Write the table of this process's new measurements (atomically; never fatal)."""
    global _new_entries
    with _lock:
        if not _new_entries or _table is None:
            return
        try:
            path = _cache_path()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({k: list(v) for k, v in sorted(_table.items())}, indent=0))
            os.replace(tmp, path)
            _new_entries = False
        except OSError as exc:
            logger.debug("kernel choices not cached: %s", exc)


# A bucket whose product would take longer than this (at 100 GFLOP/s) is not measured: it takes
# the winner of the bucket below (an LM head of 49k rows at 512 tokens would cost 0.3 s a call).
_MAX_CALL_FLOPS = 100e9 * 0.02


def _median_call_s(fn: Callable[[], object]) -> float:
    fn()  # warm-up (first-touch of buffers, the kernel's thread pool)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def choose(key: str, candidates: dict[str, Callable[[torch.Tensor], object]], in_features: int,
           default: str, out_features: int) -> tuple[str, ...]:
    """The fastest candidate per bucket for shape `key` (measured once per machine). Each
    candidate is `fn(x)` for `x [M, in_features]` float32. `default` wins where nothing is
    measured (budget spent, or `PAGEDLLM_KERNEL_CHOICE=kernel`)."""
    paths = _choose(key, candidates, in_features, default, out_features)
    _used[key] = paths
    return paths


def _choose(key: str, candidates: dict[str, Callable[[torch.Tensor], object]], in_features: int,
            default: str, out_features: int) -> tuple[str, ...]:
    global _spent_s, _new_entries
    chosen_mode = mode()
    if chosen_mode == "kernel" or len(candidates) == 1:
        return (default,) * len(BUCKETS)
    if chosen_mode == "torch" and "torch" in candidates:
        return ("torch",) * len(BUCKETS)
    with _lock:
        table = _load()
        if key in table and all(w in candidates for w in table[key]):
            return table[key]
        if _spent_s >= _budget_s():
            return (default,) * len(BUCKETS)
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(0)
        winners = []
        for m in BUCKETS:
            if winners and 2 * m * in_features * out_features > _MAX_CALL_FLOPS:
                winners.append(winners[-1])
                continue
            x = torch.randn(m, in_features, generator=g)
            times = {name: _median_call_s(lambda fn=fn: fn(x)) for name, fn in candidates.items()}
            winners.append(min(times, key=times.get))
        _spent_s += time.perf_counter() - t0
        table[key] = tuple(winners)
        _new_entries = True
    logger.debug("kernel choice %s: %s", key, dict(zip(BUCKETS, winners)))
    return tuple(winners)


def spent_seconds() -> float:
    """Seconds this process spent measuring (the start-up cost of the choice)."""
    return _spent_s


_used: dict[str, tuple[str, ...]] = {}  # the shapes this process's layers asked for


def log_summary() -> None:
    """One start-up line: how long the measurement took and where torch's op was kept."""
    if not _used:
        return
    torch_kept = {k: [b for b, w in zip(BUCKETS, v) if w == "torch"] for k, v in _used.items()}
    torch_kept = {k: v for k, v in torch_kept.items() if v}
    logger.info("Kernel choice (%s): %d shapes, %.2f s measured%s", mode(), len(_used), _spent_s,
                "; torch's op kept for " + "; ".join(f"{k} at {v} rows" for k, v in torch_kept.items())
                if torch_kept else "; the C kernels win every bucket")


def used() -> dict[str, tuple[str, ...]]:
    """The choice of every shape this process's layers asked for."""
    return dict(_used)

"""Keep the faster of pagedllm's C kernel and torch's own op, per shape and batch size, on the
machine the engine runs on — with a rule that noise cannot poison.

Why measure at all: a hand kernel tuned on one CPU can lose to torch's (MKL / oneDNN) op on another,
and the relation flips with the batch size. Why so carefully: one noisy measurement (a first start
while a build ran, each candidate timed three times with that layer's weight in cache) once kept
torch's float32 op for 3 of 5 shapes of the default model, cached the verdict for good and made the
default 3.5x slower than its own kernels. So:

- Candidates are timed interleaved (ROUNDS rounds, one call each per round), twice; the default
  (the C kernel) loses a bucket only if another candidate beats it by MARGIN in both medians.
- While measuring, the CPU time other processes take is watched (/proc/stat against this
  process's own CPU time). Past NOISY_SHARE of the CPUs, the shape keeps the default and nothing
  this process measured is cached (a later, quiet start measures again).
- Quantized weights are not measured in the default mode: torch's op would need a float32 copy
  of the weight (4-8x its packed bytes), and memory is the user's. Only `PAGEDLLM_KERNEL_CHOICE=torch`
  (an A/B switch) makes such copies.
- A verdict for a non-default path — measured now or read from the cache — is re-checked during
  real calls: every RECHECK_EVERY calls of a bucket, both paths run once on the real input; when
  the default wins LOSSES_TO_EXPIRE of the last RECHECK_WINDOW checks the bucket returns to the
  default in every layer of the shape, and the cached table is rewritten.

A call with M rows uses the bucket nearest M (log scale: 1, 8, 32, 128, 512). Layers of one shape
share one `Choice`; the table is cached per machine in the kernel cache folder (`choices-<key>.json`,
keyed by the CPU, the kernel variant, the kernel sources, torch's version and the thread count).

Cost: at most `PAGEDLLM_KERNEL_CHOICE_BUDGET` seconds (default 1.0) of measurement per process;
shapes left when it is spent keep the C kernel and are not cached. `PAGEDLLM_KERNEL_CHOICE`:
`measure` (default), `kernel` (always the C kernels), `torch` (always torch's op; A/B runs).

Exactness is unchanged by the choice: every candidate multiplies the same float32 weights
(`exact` and `torch` differ only in summation order); `int8` is a candidate only where the
user's `quant_compute` already asked for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedllm import envs
from pagedllm.kernels.build import _SOURCE_DIR, _cpu_signature
from pagedllm.kernels.isa import select_variant
from pagedllm.model_source import cache_dir

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
    return envs.PAGEDLLM_KERNEL_CHOICE


def _budget_s() -> float:
    return envs.PAGEDLLM_KERNEL_CHOICE_BUDGET


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
    """Write the table of this process's new measurements (atomically; never fatal); nothing
    after a measurement that other processes disturbed."""
    global _new_entries
    with _lock:
        if not _new_entries or _table is None or _noisy:
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


ROUNDS = 5  # interleaved timings per candidate in one median
MARGIN = 1.25  # how much faster than the default another candidate must be, in both medians
NOISY_SHARE = 0.15  # share of the CPUs other processes may take while measuring
RECHECK_EVERY = 512  # calls of a non-default bucket between two re-checks on real input
RECHECK_WINDOW = 5
LOSSES_TO_EXPIRE = 3


class CpuWatch:
    """The CPU time other processes take, from `start()` on: the whole system's busy time
    (/proc/stat) minus this process's own (Linux; elsewhere it reports 0)."""

    def __init__(self) -> None:
        self._t0: tuple[float, float, float] | None = None

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # all but idle, iowait
        own = os.times()
        return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.monotonic()

    def start(self) -> None:
        if self._t0 is None:
            self._t0 = self._sample()

    def others_share(self) -> float:
        """Other processes' CPU time since `start()`, as a share of all CPUs' wall time."""
        now = self._sample()
        if self._t0 is None or now is None:
            return 0.0
        wall = (now[2] - self._t0[2]) * (os.cpu_count() or 1)
        if wall <= 0:
            return 0.0
        return max(0.0, (now[0] - self._t0[0]) - (now[1] - self._t0[1])) / wall


_watch = CpuWatch()
_noisy = False  # other processes took the CPUs while this process measured: cache nothing


def _interleaved_medians(candidates: dict[str, Callable[[], object]]) -> dict[str, float]:
    for fn in candidates.values():
        fn()  # warm-up (first-touch of buffers, the kernel's thread pool)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(ROUNDS):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


def winner(candidates: dict[str, Callable[[], object]], default: str) -> str:
    """The default, unless another candidate beats it by MARGIN in two separate medians."""
    first = _interleaved_medians(candidates)
    best = min(first, key=first.get)
    if best == default or first[default] < MARGIN * first[best]:
        return default
    second = _interleaved_medians(candidates)
    return best if second[default] >= MARGIN * second[best] else default


_generation = 0  # bumped whenever a kept path changes: plans made from the paths are then stale


def generation() -> int:
    """A counter that changes whenever any shape's path for a bucket changes (a re-check
    expired it): what a plan built from the paths (worker/cpu_decode_step.py) is valid for."""
    return _generation


class Choice:
    """The path per batch bucket of one shape, shared by every layer of that shape, so that a
    re-check that returns a bucket to the default does so for all of them."""

    __slots__ = ("key", "paths", "default", "_rechecks", "_calls", "_checks")

    def __init__(self, key: str, paths: tuple[str, ...], default: str) -> None:
        self.key, self.paths, self.default = key, list(paths), default
        self._rechecks = mode() == "measure"  # `torch` mode's paths are asked for, not measured
        self._calls = [0] * len(BUCKETS)
        self._checks: list[list[bool]] = [[] for _ in BUCKETS]

    def __getitem__(self, bucket: int) -> str:
        return self.paths[bucket]

    def __len__(self) -> int:
        return len(self.paths)

    def __iter__(self):
        return iter(self.paths)

    def __eq__(self, other: object) -> bool:
        return tuple(self.paths) == tuple(other) if isinstance(other, (tuple, list, Choice)) else NotImplemented

    def __repr__(self) -> str:
        return f"Choice({self.key!r}, {tuple(self.paths)})"

    def due(self, bucket: int) -> bool:
        """Whether this call of a non-default bucket should re-check it (every RECHECK_EVERY calls)."""
        if self.paths[bucket] == self.default or not self._rechecks:
            return False
        self._calls[bucket] += 1
        return self._calls[bucket] % RECHECK_EVERY == 0

    def recheck_if_due(self, bucket: int, kept: Callable[[], object], default: Callable[[], object]) -> None:
        """What a layer calls on each call of a non-default bucket: `recheck` when `due`."""
        if self.due(bucket):
            self.recheck(bucket, kept, default)

    def recheck(self, bucket: int, kept: Callable[[], object], default: Callable[[], object]) -> None:
        """Time both paths once each on the real input; expire the bucket when the default keeps winning."""
        t0 = time.perf_counter()
        kept()
        t1 = time.perf_counter()
        default()
        t2 = time.perf_counter()
        checks = self._checks[bucket]
        checks.append(t2 - t1 < t1 - t0)
        del checks[:-RECHECK_WINDOW]
        if sum(checks) >= LOSSES_TO_EXPIRE:
            self._expire(bucket)

    def _expire(self, bucket: int) -> None:
        global _new_entries, _generation
        _generation += 1
        logger.info("Kernel choice: %s at %d rows returns to %s (it won %d of the last %d checks on real input)",
                    self.key, BUCKETS[bucket], self.default, sum(self._checks[bucket]), len(self._checks[bucket]))
        self.paths[bucket] = self.default
        self._checks[bucket].clear()
        with _lock:
            table = _load()
            if self.key in table:
                table[self.key] = tuple(self.paths)
                _new_entries = True
        save()


_choices: dict[str, Choice] = {}


def choose(key: str, candidates: dict[str, Callable[[torch.Tensor], object]], in_features: int,
           default: str, out_features: int) -> Choice:
    """The path per bucket for shape `key` (measured once per machine; shared by all layers of the
    shape). Each candidate is `fn(x)` for `x [M, in_features]` float32. `default` is kept where
    nothing is measured (budget spent, a noisy machine, `PAGEDLLM_KERNEL_CHOICE=kernel`) and
    wherever no other candidate beats it clearly."""
    paths = tuple(_choose(key, candidates, in_features, default, out_features))
    choice = _choices.get(key)
    if choice is None or tuple(choice.paths) != paths or choice.default != default:
        choice = _choices[key] = Choice(key, paths, default)
    _used[key] = choice
    return choice


def _choose(key: str, candidates: dict[str, Callable[[torch.Tensor], object]], in_features: int,
            default: str, out_features: int) -> tuple[str, ...]:
    global _spent_s, _new_entries, _noisy
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
        _watch.start()
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(0)
        winners: list[str] = []
        for m in BUCKETS:
            if winners and 2 * m * in_features * out_features > _MAX_CALL_FLOPS:
                winners.append(winners[-1])
                continue
            x = torch.randn(m, in_features, generator=g)
            winners.append(winner({name: (lambda fn=fn: fn(x)) for name, fn in candidates.items()}, default))
        _spent_s += time.perf_counter() - t0
        share = _watch.others_share()
        if share > NOISY_SHARE:
            if not _noisy:
                logger.warning("Kernel choice: other processes took %.0f%% of the CPUs while measuring; the C "
                               "kernels are kept and nothing measured is cached", 100 * share)
            _noisy = True
        if _noisy:
            return (default,) * len(BUCKETS)
        table[key] = tuple(winners)
        _new_entries = True
    logger.debug("kernel choice %s: %s", key, dict(zip(BUCKETS, winners)))
    return tuple(winners)


def spent_seconds() -> float:
    """Seconds this process spent measuring (the start-up cost of the choice)."""
    return _spent_s


_used: dict[str, Choice] = {}  # the shapes this process's layers asked for


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
    return {k: tuple(v.paths) for k, v in _used.items()}

"""The engine core's view of the LoRA adapters: which requests use which adapter.

The core checks and loads an adapter when the first request for it is added (a bad adapter is
that request's `ValueError`, a 400 on the server; nothing else is disturbed), and keeps it
*pinned* in rank 0's host memory while any request uses it: a step never reads an adapter from
disk, so a step cannot fail on a file that changed or vanished after the check. Unpinned
adapters stay loaded up to `max_cpu_loras` (least recently used first out) and are read
again when a later request names them. vLLM's LRU may evict the adapter of a waiting request
and reload it in the step; pinning keeps that failure out of the step (the cost: more than
`max_cpu_loras` adapters may be loaded while more than that many are in use).

An adapter id is bound to its name and path for as long as it is loaded: another adapter under
the same id is refused, and the prefix cache keys blocks by id, name and path
(`lora_cache_key`), so a block computed under one adapter never serves another.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

from pagedllm.lora.request import LoRARequest


def lora_cache_key(lora: LoRARequest) -> str:
    """The adapter's identity in the prefix-cache hash."""
    return f"{lora.lora_int_id}:{lora.lora_name}:{lora.lora_path}"


class CoreLoRAs:
    """Pins per adapter id over rank 0's `WorkerLoRAManager` (lora/worker_manager.py)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.requests: dict[int, LoRARequest] = {}  # every adapter known (loaded or in use)
        self.pins: collections.Counter[int] = collections.Counter()  # requests using it
        self._removing: set[int] = set()  # removed while in use: dropped at the last release
        self._pinned: set[int] = set()  # vLLM's pin_lora: held in host memory until removed

    def _check_same(self, lora: LoRARequest) -> None:
        known = self.requests.get(lora.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (lora.lora_name, lora.lora_path):
            raise ValueError(f"lora_int_id {lora.lora_int_id} is already adapter {known.lora_name!r} "
                             f"({known.lora_path}); adapter {lora.lora_name!r} ({lora.lora_path}) needs another id.")

    def add(self, lora: LoRARequest) -> bool:
        """Load `lora` (unpinned) now: the server's start-up modules and `load_lora_adapter`."""
        self._check_same(lora)
        self.manager.load(lora)
        self.requests[lora.lora_int_id] = lora
        self._removing.discard(lora.lora_int_id)
        return True

    def acquire(self, lora: LoRARequest) -> None:
        """A request starts using `lora`: loaded and checked if needed, then pinned."""
        self._check_same(lora)
        if lora.lora_int_id in self._removing:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} is being unloaded.")
        self.manager.load(lora)  # no-op when held; ValueError for a bad adapter
        self.requests[lora.lora_int_id] = lora
        self.pins[lora.lora_int_id] += 1
        self.manager.hold(lora.lora_int_id)

    def release(self, lora_int_id: int) -> None:
        """A request using the adapter left the core."""
        self.pins[lora_int_id] -= 1
        if self.pins[lora_int_id] > 0:
            return
        del self.pins[lora_int_id]
        if lora_int_id not in self._pinned:
            self.manager.release(lora_int_id)
        if lora_int_id in self._removing:
            self._forget(lora_int_id)

    def remove(self, lora_int_id: int) -> bool:
        """Unload an adapter; one in use goes when its last request leaves. False: not known."""
        if lora_int_id not in self.requests:
            return False
        if self.pins[lora_int_id] > 0:
            self._removing.add(lora_int_id)
        else:
            self._forget(lora_int_id)
        return True

    def pin(self, lora_int_id: int) -> bool:
        """vLLM's `pin_lora`: a loaded adapter stays in host memory (never evicted by
        `max_cpu_loras`) until it is removed. False: not loaded."""
        if lora_int_id not in self.requests or lora_int_id in self._removing:
            return False
        self._pinned.add(lora_int_id)
        self.manager.hold(lora_int_id)
        return True

    def _forget(self, lora_int_id: int) -> None:
        self._pinned.discard(lora_int_id)
        self._removing.discard(lora_int_id)
        self.requests.pop(lora_int_id, None)
        self.manager.remove(lora_int_id)

    def list(self) -> list[int]:
        return sorted(i for i in self.requests if i not in self._removing)

    def requests_of(self, scheduled: Iterable[Any]) -> dict[int, LoRARequest]:
        """The adapters of a step's scheduled sequences, by id (what the runners must hold)."""
        ids = {s.seq.lora_int_id for s in scheduled if s.seq.lora_int_id}
        return {i: self.requests[i] for i in ids}

    def names_of(self, ids: Iterable[int]) -> list[str]:
        """The names of the adapters among `ids` (0: the base model, left out), sorted."""
        return sorted({self.requests[i].lora_name for i in ids if i and i in self.requests})


def check_lora_enabled(loras: CoreLoRAs | None, lora: LoRARequest | None) -> LoRARequest | None:
    """`lora` when the engine serves adapters (`loras` is not None); a ValueError otherwise."""
    if lora is not None and loras is None:
        raise ValueError(f"LoRA adapter {lora.lora_name!r} requested, but LoRA is not enabled: start the "
                         "engine with enable_lora=True (--enable-lora).")
    return lora

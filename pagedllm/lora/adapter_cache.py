"""`LoRASlots`: which loaded adapter sits in which device slot (vLLM's worker LoRA manager).

Two levels, as vLLM's `LRUCacheWorkerLoRAManager`:
- the host cache: up to `max_cpu_loras` loaded adapters (`LoRAAdapter`, float32 on the host),
  least recently used evicted first when another must be loaded;
- `max_loras` device slots: what one step's batch can use at once. The integration keeps slot
  tensors (A / B of every slot, sized by `max_lora_rank`) and copies an adapter in when it is
  activated (`on_activate(slot, adapter)`); a step's rows then carry slot indices.

A step names its adapters first (`begin_step`): they are activated (a free slot, else the least
recently used slot that this step does not use) and pinned until the next step, so nothing the
running batch reads is evicted, from a slot or from the host cache. The engine core also
*holds* the adapters of its live requests (`hold` / `release`, lora/core_registry.py): a held
adapter never leaves the host cache, so no step has to read one from disk; while more adapters
are held than `max_cpu_loras`, the cache holds them all and shrinks back as they are released. A step that needs more than
`max_loras` distinct adapters is a RuntimeError before anything changes (the scheduler must keep
a step's distinct adapters within `max_loras`, as vLLM's does). No model and no device here:
the callbacks do the copies.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from pagedllm.lora.adapter import LoRAAdapter
from pagedllm.lora.request import LoRARequest


class LoRASlots:
    """Device slots 0..max_loras-1 over an LRU host cache of loaded adapters, keyed by `lora_int_id`.

    `loader(request) -> LoRAAdapter` loads an adapter not in the host cache (e.g.
    `functools.partial(load_peft_adapter, spec=..., max_lora_rank=...)`); a failed load changes
    nothing. `on_activate(slot, adapter)` is called when an adapter enters a slot,
    `on_deactivate(slot, lora_int_id)` when one leaves it (evicted or removed)."""

    def __init__(self, max_loras: int, max_cpu_loras: int | None, loader: Callable[[LoRARequest], LoRAAdapter], *,
                 on_activate: Callable[[int, LoRAAdapter], None] | None = None,
                 on_deactivate: Callable[[int, int], None] | None = None) -> None:
        max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._loader = loader
        self._on_activate = on_activate
        self._on_deactivate = on_deactivate
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self._active: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recently used first
        self._slots: list[int | None] = [None] * max_loras  # slot -> lora id
        self._pinned: set[int] = set()  # the current step's adapters
        self._held: set[int] = set()  # adapters of live requests (the engine core's)
        self._requests: dict[int, LoRARequest] = {}  # what each cached id was loaded from

    # ---- a step ------------------------------------------------------------------------
    def begin_step(self, requests: Iterable[LoRARequest]) -> dict[int, int]:
        """Activate this step's adapters and pin them until the next step: `{lora_int_id: slot}`.
        RuntimeError, with nothing changed, when they are more than `max_loras`."""
        wanted = list(dict.fromkeys(requests))  # distinct by lora_int_id, in order
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step asks for {len(wanted)} distinct LoRA adapters "
                               f"{[r.lora_int_id for r in wanted]}, more than max_loras={self.max_loras}")
        self._pinned = set()
        return {r.lora_int_id: self.slot_for(r) for r in wanted}

    def end_step(self) -> None:
        """Unpin the step's adapters (the next `begin_step` does it too)."""
        self._pinned = set()

    def slot_for(self, request: LoRARequest) -> int:
        """The slot of `request`'s adapter, loaded and activated if needed, and pinned for this step."""
        lora_id = request.lora_int_id
        self._forget_if_renamed(request)
        if lora_id in self._active:
            self._touch(lora_id)
            self._pinned.add(lora_id)
            return self._active[lora_id]
        if len(self._pinned) >= self.max_loras:
            raise RuntimeError(f"LoRA adapter {lora_id} needs a slot, but all max_loras={self.max_loras} slots "
                               f"hold adapters of this step {sorted(self._pinned)}")
        adapter = self.add(request)
        slot = self._free_slot()
        if self._on_activate is not None:
            self._on_activate(slot, adapter)
        self._slots[slot] = lora_id
        self._active[lora_id] = slot
        self._pinned.add(lora_id)
        return slot

    # ---- the host cache ----------------------------------------------------------------
    def add(self, request: LoRARequest) -> LoRAAdapter:
        """`request`'s adapter in the host cache (loaded if absent, else marked recently used)."""
        lora_id = request.lora_int_id
        self._forget_if_renamed(request)
        if lora_id in self._host:
            self._host.move_to_end(lora_id)
            return self._host[lora_id]
        adapter = self._loader(request)
        if adapter.lora_int_id != lora_id:
            raise ValueError(f"the loader returned adapter {adapter.lora_int_id} for LoRA request {lora_id}")
        if len(self._host) >= self.max_cpu_loras:
            victim = next((i for i in self._host if i not in self._pinned and i not in self._held), None)
            if victim is None and not self._held:
                raise RuntimeError(f"cannot load LoRA adapter {lora_id}: the host cache (max_cpu_loras="
                                   f"{self.max_cpu_loras}) holds only adapters of this step")
            if victim is not None:
                self._unload(victim)
        self._host[lora_id] = adapter
        self._requests[lora_id] = request
        return adapter

    def hold(self, lora_int_id: int) -> None:
        """A live request uses the (loaded) adapter: it stays in the host cache until released."""
        self._held.add(lora_int_id)

    def release(self, lora_int_id: int) -> None:
        """No live request uses it any more: the cache shrinks back to `max_cpu_loras`."""
        self._held.discard(lora_int_id)
        over = len(self._host) - self.max_cpu_loras
        for victim in [i for i in self._host if i not in self._pinned and i not in self._held][:max(0, over)]:
            self._unload(victim)

    def _forget_if_renamed(self, request: LoRARequest) -> None:
        """An id that now names another adapter (another name or path: a rank that did not see
        its removal) is unloaded first, so its old weights are never used."""
        known = self._requests.get(request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            self.remove(request.lora_int_id)

    def remove(self, lora_int_id: int) -> bool:
        """Unload an adapter (its slot freed); False if it was not loaded. RuntimeError while the
        current step uses it."""
        if lora_int_id in self._pinned:
            raise RuntimeError(f"LoRA adapter {lora_int_id} is in use by the current step; remove it after")
        self._held.discard(lora_int_id)
        if lora_int_id not in self._host:
            return False
        self._unload(lora_int_id)
        return True

    def loaded_ids(self) -> list[int]:
        """The host cache's adapters, least recently used first."""
        return list(self._host)

    @property
    def slots(self) -> tuple[int | None, ...]:
        """Slot -> the lora_int_id in it (None: free)."""
        return tuple(self._slots)

    # ---- inside ------------------------------------------------------------------------
    def _touch(self, lora_id: int) -> None:
        self._active.move_to_end(lora_id)
        self._host.move_to_end(lora_id)

    def _free_slot(self) -> int:
        """The lowest free slot, else the least recently used one not pinned (its adapter
        deactivated, still in the host cache)."""
        if None in self._slots:
            return self._slots.index(None)
        victim = next(i for i in self._active if i not in self._pinned)  # exists: pinned < max_loras
        return self._deactivate(victim)

    def _deactivate(self, lora_id: int) -> int:
        slot = self._active.pop(lora_id)
        self._slots[slot] = None
        if self._on_deactivate is not None:
            self._on_deactivate(slot, lora_id)
        return slot

    def _unload(self, lora_id: int) -> None:
        if lora_id in self._active:
            self._deactivate(lora_id)
        del self._host[lora_id]
        self._requests.pop(lora_id, None)

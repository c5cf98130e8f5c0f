"""`LoRASlots` (pagedllm/lora/adapter_cache.py): exact slot and host-cache eviction order,
pinning of a step's adapters, unload, the over-capacity errors, and the activation hooks
copying an adapter into slot tensors. No model: a loader that makes tiny adapters."""

from __future__ import annotations

import pytest
import torch

from pagedllm.lora.adapter import LoRAAdapter, LoRALayerWeights
from pagedllm.lora.adapter_cache import LoRASlots
from pagedllm.lora.request import LoRARequest


def req(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/{i}")


class Recorder:
    """The loader and both hooks, logging every call in order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.fail: set[int] = set()

    def load(self, r: LoRARequest) -> LoRAAdapter:
        if r.lora_int_id in self.fail:
            raise ValueError(f"cannot load {r.lora_int_id}")
        self.log.append(("load", r.lora_int_id))
        w = LoRALayerWeights(torch.full((2, 4), float(r.lora_int_id)), torch.ones(3, 2), 1.0)
        return LoRAAdapter(r.lora_name, r.lora_int_id, 2, 1.0, {(0, "q_proj"): w})

    def activate(self, slot: int, adapter: LoRAAdapter) -> None:
        self.log.append(("on", slot, adapter.lora_int_id))

    def deactivate(self, slot: int, lora_id: int) -> None:
        self.log.append(("off", slot, lora_id))

    def slots(self, max_loras: int, max_cpu_loras: int | None) -> LoRASlots:
        return LoRASlots(max_loras, max_cpu_loras, self.load, on_activate=self.activate,
                         on_deactivate=self.deactivate)

    def take(self) -> list[tuple]:
        log, self.log = self.log, []
        return log


def test_slots_fill_low_first_then_evict_least_recently_used_unpinned():
    rec = Recorder()
    s = rec.slots(2, 4)
    assert s.begin_step([req(1), req(2)]) == {1: 0, 2: 1}
    assert rec.take() == [("load", 1), ("on", 0, 1), ("load", 2), ("on", 1, 2)]
    assert s.begin_step([req(2)]) == {2: 1}  # 2 is now the most recently used
    assert rec.take() == []
    assert s.begin_step([req(3)]) == {3: 0}  # slot of 1, the least recently used
    assert rec.take() == [("load", 3), ("off", 0, 1), ("on", 0, 3)]
    assert s.slots == (3, 2) and s.loaded_ids() == [1, 2, 3]  # 1 stays in the host cache
    assert s.begin_step([req(1), req(3)]) == {1: 1, 3: 0}  # back from the host cache: no load
    assert rec.take() == [("off", 1, 2), ("on", 1, 1)]
    assert s.loaded_ids() == [2, 1, 3]


def test_host_cache_evicts_least_recently_used_and_frees_its_slot():
    rec = Recorder()
    s = rec.slots(2, 3)
    s.begin_step([req(1), req(2)])
    s.add(req(3))  # host only
    s.end_step()
    assert s.slots == (1, 2) and s.loaded_ids() == [1, 2, 3]
    rec.take()
    s.begin_step([req(4)])  # host full: 1 (least recently used) unloaded, its slot freed and reused
    assert rec.take() == [("load", 4), ("off", 0, 1), ("on", 0, 4)]
    assert s.slots == (4, 2) and s.loaded_ids() == [2, 3, 4]
    s.add(req(2))  # the host cache's recency only: 2 stays the least recently used slot
    s.begin_step([req(5)])  # host: 3 unloaded (no slot); slots: 2's taken
    assert rec.take() == [("load", 5), ("off", 1, 2), ("on", 1, 5)]
    assert s.slots == (4, 5) and s.loaded_ids() == [4, 2, 5]


def test_default_host_capacity_is_max_loras():
    s = LoRASlots(2, None, Recorder().load)
    assert s.max_cpu_loras == 2
    for i in (1, 2, 3):
        s.begin_step([req(i)])
    assert s.loaded_ids() == [2, 3] and s.slots == (3, 2)


def test_pinned_adapters_are_never_evicted():
    rec = Recorder()
    s = rec.slots(2, 2)
    s.begin_step([req(1), req(2)])
    rec.take()
    with pytest.raises(RuntimeError, match=r"adapter 3 needs a slot, but all max_loras=2 slots hold adapters "
                                           r"of this step \[1, 2\]"):
        s.slot_for(req(3))
    with pytest.raises(RuntimeError, match=r"cannot load LoRA adapter 3: the host cache \(max_cpu_loras=2\) holds "
                                           "only adapters of this step"):
        s.add(req(3))
    assert rec.take() == [("load", 3)] and s.slots == (1, 2) and s.loaded_ids() == [1, 2]
    assert s.slot_for(req(2)) == 1  # an adapter of the step: its slot, nothing changes
    s.end_step()
    assert s.slot_for(req(3)) == 0  # unpinned now: 1 was the least recently used
    assert s.loaded_ids() == [2, 3]


def test_a_step_over_max_loras_changes_nothing():
    rec = Recorder()
    s = rec.slots(2, 3)
    s.begin_step([req(1)])
    rec.take()
    with pytest.raises(RuntimeError, match=r"a step asks for 3 distinct LoRA adapters \[2, 3, 4\], more than "
                                           "max_loras=2"):
        s.begin_step([req(2), req(3), req(2), req(4)])
    assert rec.take() == [] and s.slots == (1, None) and s.loaded_ids() == [1]
    assert s.begin_step([req(2), req(3), req(2)]) == {2: 1, 3: 0}  # duplicates count once


def test_remove_unloads_and_frees_the_slot():
    rec = Recorder()
    s = rec.slots(2, 3)
    s.begin_step([req(1), req(2)])
    with pytest.raises(RuntimeError, match="LoRA adapter 2 is in use by the current step"):
        s.remove(2)
    s.end_step()
    rec.take()
    assert s.remove(2) is True
    assert rec.take() == [("off", 1, 2)] and s.slots == (1, None) and s.loaded_ids() == [1]
    assert s.remove(2) is False and s.remove(9) is False
    s.add(req(5))
    assert s.remove(5) is True and rec.take() == [("load", 5)]  # host only: no slot to free
    s.begin_step([req(2)])  # loaded again, into the free slot
    assert rec.take() == [("load", 2), ("on", 1, 2)]


def test_failed_load_changes_nothing():
    rec = Recorder()
    s = rec.slots(1, 1)
    s.begin_step([req(1)])
    s.end_step()
    rec.fail.add(2)
    with pytest.raises(ValueError, match="cannot load 2"):
        s.begin_step([req(2)])
    assert s.slots == (1,) and s.loaded_ids() == [1]


def test_bad_sizes_and_loader():
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LoRASlots(2, 1, Recorder().load)
    with pytest.raises(ValueError, match="max_loras must be at least 1, got 0"):
        LoRASlots(0, None, Recorder().load)
    s = LoRASlots(1, None, lambda r: Recorder().load(req(r.lora_int_id + 1)))
    with pytest.raises(ValueError, match="the loader returned adapter 2 for LoRA request 1"):
        s.slot_for(req(1))


def test_activation_hook_fills_slot_tensors():
    """How the integration uses the hooks: per-slot A tensors written on activation, zeroed on release."""
    slot_a = torch.zeros(2, 2, 4)
    slots = LoRASlots(2, 3, Recorder().load,
                      on_activate=lambda slot, a: slot_a[slot].copy_(a.get(0, "q_proj").lora_a),
                      on_deactivate=lambda slot, _: slot_a[slot].zero_())
    slots.begin_step([req(5), req(6)])
    slots.begin_step([req(7)])  # evicts 5 from slot 0
    assert slot_a[:, 0, 0].tolist() == [7.0, 6.0]
    slots.end_step()
    slots.remove(6)
    assert slot_a[:, 0, 0].tolist() == [7.0, 0.0]

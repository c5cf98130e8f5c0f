"""A rank's LoRA adapters: loaded in host memory, activated into the model's slots per step.

Two levels, as vLLM's worker manager:
- host memory: adapters read from their PEFT folders (lora/peft_adapter.py), at most
  `max_cpu_loras` kept, least recently used first out, except *pinned* ones (rank 0's engine
  core pins the adapters of live requests: lora/core_registry.py);
- the model's `max_loras` slots (lora/layers.py): an adapter a step needs is copied into a
  free slot, or into the least recently used slot that this step does not use. The scheduler
  never runs more than `max_loras` adapters in one step, so a slot is always found.

`slot_of(lora_int_id)` then gives each scheduled sequence's slot (-1: the base model), and
the runner puts the step's per-token slots into the shared `LoRAStepContext` before the
forward. Other tensor-parallel ranks hold no pins: they load an adapter from the path in the
step message when a step first needs it.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.lora.layers import LORA_TARGETS, LoRALinear, LoRAStepContext, attach_lora
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAWorkerConfig:
    """The LoRA knobs a rank needs (picklable: sent to tensor-parallel workers)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


class WorkerLoRAManager:
    def __init__(self, model: nn.Module, hf_config: Any, config: LoRAWorkerConfig) -> None:
        from pagedllm.lora.peft_adapter import lora_model_spec

        self.config = config
        self.spec = lora_model_spec(hf_config)  # the model's target modules and sizes (checked)
        self.context: LoRAStepContext
        self.context, self.layers = attach_lora(model, config.max_loras, config.max_lora_rank)
        self.host: collections.OrderedDict[int, Any] = collections.OrderedDict()  # id -> LoRAAdapter, LRU
        self.requests: dict[int, LoRARequest] = {}  # what each held id was loaded from
        self.pinned: set[int] = set()
        self.slots: list[int | None] = [None] * config.max_loras  # slot -> adapter id
        self._slot_of: dict[int, int] = {}
        self._slot_used: list[float] = [0.0] * config.max_loras  # when each slot last served a step

    # ---- host memory ----------------------------------------------------------------------

    def load(self, lora: LoRARequest) -> None:
        """Read and check `lora` into host memory unless held; a bad adapter is a ValueError
        naming the file or tensor."""
        held = self.requests.get(lora.lora_int_id)
        if held is not None and (held.lora_name, held.lora_path) != (lora.lora_name, lora.lora_path):
            self.remove(lora.lora_int_id)  # the id now names another adapter (this rank missed the removal)
        if lora.lora_int_id in self.host:
            self.host.move_to_end(lora.lora_int_id)
            return
        from pagedllm.lora.peft_adapter import load_peft_adapter

        t0 = time.perf_counter()
        adapter = load_peft_adapter(lora.lora_path, self.spec, max_rank=self.config.max_lora_rank,
                                    name=lora.lora_name, lora_int_id=lora.lora_int_id)
        self.host[lora.lora_int_id] = adapter
        self.requests[lora.lora_int_id] = lora
        logger.info("LoRA adapter %r (id %d, rank %d) loaded from %s in %.0f ms", lora.lora_name,
                    lora.lora_int_id, adapter.rank, lora.lora_path, 1e3 * (time.perf_counter() - t0))
        self._evict_host()

    def _evict_host(self) -> None:
        """Down to `max_cpu_loras`: the least recently used adapters that are neither pinned
        nor in a slot go first."""
        over = len(self.host) - self.config.max_cpu_loras
        for lora_id in list(self.host):
            if over <= 0:
                break
            if lora_id not in self.pinned and lora_id not in self._slot_of:
                del self.host[lora_id]
                self.requests.pop(lora_id, None)
                over -= 1

    def pin(self, lora_int_id: int) -> None:
        self.pinned.add(lora_int_id)

    def unpin(self, lora_int_id: int) -> None:
        self.pinned.discard(lora_int_id)
        self._evict_host()

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter: out of host memory and out of its slot."""
        self.pinned.discard(lora_int_id)
        self.host.pop(lora_int_id, None)
        self.requests.pop(lora_int_id, None)
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.slots[slot] = None
            for layer in self.layers.values():
                layer.clear_slot(slot)

    def loaded_ids(self) -> list[int]:
        return list(self.host)

    # ---- slots ----------------------------------------------------------------------------

    def begin_step(self, requests: dict[int, LoRARequest]) -> None:
        """Put every adapter of the step into a slot (loading it here if this rank lacks it)."""
        if len(requests) > self.config.max_loras:
            raise RuntimeError(f"a step with {len(requests)} LoRA adapters; max_loras={self.config.max_loras}")
        now = time.monotonic()
        for lora_id, lora in requests.items():  # the ones already in a slot stay there
            held = self.requests.get(lora_id)
            if held is not None and (held.lora_name, held.lora_path) != (lora.lora_name, lora.lora_path):
                self.remove(lora_id)  # reloaded below from its new path
            elif lora_id in self._slot_of:
                self._slot_used[self._slot_of[lora_id]] = now
        for lora_id, lora in requests.items():
            if lora_id in self._slot_of:
                continue
            self.load(lora)
            slot = self._free_slot(set(requests))
            self._activate(slot, lora_id)
            self._slot_used[slot] = now

    def _free_slot(self, needed: set[int]) -> int:
        for slot, held in enumerate(self.slots):
            if held is None:
                return slot
        candidates = [s for s, held in enumerate(self.slots) if held not in needed]
        slot = min(candidates, key=lambda s: self._slot_used[s])
        del self._slot_of[self.slots[slot]]
        self.slots[slot] = None
        return slot

    def _activate(self, slot: int, lora_id: int) -> None:
        """Copy the adapter's A and B into `slot` of every target layer (zeros where it has none)."""
        adapter = self.host[lora_id]
        self.host.move_to_end(lora_id)
        for (layer_idx, name), layer in self.layers.items():
            parts = [adapter.weights.get((layer_idx, proj)) for proj in LORA_TARGETS[name]]
            if any(p is not None for p in parts):
                layer.set_slot(slot, parts)
            else:
                layer.clear_slot(slot)
        self.slots[slot] = lora_id
        self._slot_of[lora_id] = slot

    def slot_of(self, lora_int_id: int) -> int:
        """A scheduled sequence's slot this step (-1: the base model)."""
        return -1 if not lora_int_id else self._slot_of[lora_int_id]

    @property
    def slot_layers(self) -> dict[tuple[int, str], LoRALinear]:
        return self.layers

    def slot_weights(self, slot: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """What a slot holds per layer (tests: no adapter's weights in another's slot)."""
        return {key: (layer.a[slot], layer.b[slot]) for key, layer in self.layers.items()}

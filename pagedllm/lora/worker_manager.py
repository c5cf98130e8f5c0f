"""A rank's LoRA adapters: loaded in host memory, copied into the model's slots per step.

The policy (which adapter sits in which of the `max_loras` slots, which stay loaded in host
memory) is `LoRASlots`' (lora/adapter_cache.py); this class binds it to the model: it loads an
adapter for this rank (lora/peft_adapter.py, then `shard_adapter` for a tensor-parallel rank's
cut), copies it into every target layer's slot when it is activated (lora/layers.py), and gives
the runner each scheduled sequence's slot (`slot_of`, -1: the base model).

Rank 0's engine core holds the adapters of its live requests (`hold` / `release`), so that a
step never reads one from disk there. The other tensor-parallel ranks read an adapter from the
path in the step message the first time a step needs it.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

from torch import nn

from pagedllm.distributed import parallel_state
from pagedllm.lora.adapter import LoRAAdapter, shard_adapter
from pagedllm.lora.adapter_cache import LoRASlots
from pagedllm.lora.layers import LORA_TARGETS, LoRAStepContext, attach_lora
from pagedllm.lora.model_spec import LoRAModelSpec, lora_model_spec
from pagedllm.lora.peft_adapter import load_peft_adapter
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
        self.config = config
        self.spec: LoRAModelSpec = lora_model_spec(hf_config)  # a model LoRA cannot target: ValueError
        self.context: LoRAStepContext
        self.context, self.layers = attach_lora(model, config.max_loras, config.max_lora_rank)
        tp = parallel_state.tp_group()
        self.slots = LoRASlots(config.max_loras, config.max_cpu_loras,
                               functools.partial(self._load, rank=tp.rank, world=tp.world_size),
                               on_activate=self._activate, on_deactivate=self._deactivate)
        self._slot_of: dict[int, int] = {}

    def _load(self, lora: LoRARequest, rank: int, world: int) -> LoRAAdapter:
        t0 = time.perf_counter()
        adapter = load_peft_adapter(lora, self.spec, max_lora_rank=self.config.max_lora_rank)
        size = sum(w.lora_a.nbytes + w.lora_b.nbytes for w in adapter.weights.values())
        logger.info("LoRA adapter %r (id %d, rank %d, %.1f MB) loaded from %s in %.0f ms", lora.lora_name,
                    lora.lora_int_id, adapter.rank, size / 1e6, lora.lora_path, 1e3 * (time.perf_counter() - t0))
        return shard_adapter(adapter, self.spec, rank, world)

    # ---- what the engine core asks (rank 0) -----------------------------------------------

    def load(self, lora: LoRARequest) -> None:
        """Read and check `lora` into host memory unless held there: a bad adapter is a
        ValueError naming the file, field or tensor. Called between steps (the core is single-
        threaded): the previous step's adapters need no pin any more."""
        self.slots.end_step()
        self.slots.add(lora)

    def hold(self, lora_int_id: int) -> None:
        self.slots.hold(lora_int_id)

    def release(self, lora_int_id: int) -> None:
        self.slots.release(lora_int_id)

    def remove(self, lora_int_id: int) -> None:
        self.slots.remove(lora_int_id)

    # ---- a step ---------------------------------------------------------------------------

    def begin_step(self, requests: dict[int, LoRARequest]) -> None:
        """Put every adapter of the step into a slot (loading it here if this rank lacks it)."""
        self._slot_of = self.slots.begin_step(requests.values())

    def slot_of(self, lora_int_id: int) -> int:
        """A scheduled sequence's slot this step (-1: the base model)."""
        return -1 if not lora_int_id else self._slot_of[lora_int_id]

    def _activate(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy the adapter's A and B into `slot` of every target layer (zeros where it has none)."""
        for (layer_idx, name), layer in self.layers.items():
            parts = [adapter.get(layer_idx, proj) for proj in LORA_TARGETS[name]]
            if any(p is not None for p in parts):
                layer.set_slot(slot, [None if p is None else (p.lora_a, p.lora_b) for p in parts])
            else:
                layer.clear_slot(slot)

    def _deactivate(self, slot: int, lora_int_id: int) -> None:
        for layer in self.layers.values():
            layer.clear_slot(slot)

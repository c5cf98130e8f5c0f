"""The scheduler's queues and their order: the base that admission and preemption share.

`running`, `waiting` and `swapped` are kept in the scheduling order (priority, arrival,
submission; `SchedulerConfig.policy`), and a request's LoRA adapter takes one of `max_loras`
running seats. Both the admission of waiting requests and the preemption (and return) of
running ones insert by this order and count these seats, so it lives under both.
"""

from __future__ import annotations

import bisect
from collections import deque

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import SequenceState
from pagedllm.core.scheduler_config import SchedulerConfig


class SchedulerQueues:
    """The queue state (set by `Scheduler.__init__`) and the order it is kept in."""

    config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    waiting: deque[SequenceState]
    running: list[SequenceState]
    swapped: list[list[SequenceState]]
    num_preemptions: int
    num_long_context_recomputes: int
    _requests: dict[str, list[SequenceState]]
    _finished_ids: list[int]
    _request_order: dict[str, int]
    _next_request_order: int
    _lockstep: set[str]

    def _priority(self, seq: SequenceState) -> tuple[int, float, int, int, int]:
        """The scheduling order: smaller first, the largest is the preemption victim."""
        prio = seq.priority if self.config.policy == "priority" else 0
        return (prio, seq.arrival_time, self._request_order[seq.request_id], seq.index,
                seq.seq_id)

    def _insert_waiting(self, seq: SequenceState) -> None:
        """fcfs: behind every waiting sequence; priority: in (priority, arrival) order."""
        if self.config.policy == "priority":
            bisect.insort(self.waiting, seq, key=self._priority)
        else:
            self.waiting.append(seq)

    def _register(self, seq: SequenceState) -> None:
        if seq.request_id not in self._requests:
            self._requests[seq.request_id] = []
            self._request_order[seq.request_id] = self._next_request_order
            self._next_request_order += 1
        self._requests[seq.request_id].append(seq)

    def _insert_running(self, seq: SequenceState) -> None:
        bisect.insort(self.running, seq, key=self._priority)

    def _running_loras(self) -> set[int]:
        """The adapters of the running sequences (empty with LoRA off)."""
        if not self.config.max_loras:
            return set()
        return {s.lora_int_id for s in self.running if s.lora_int_id}

    def _lora_fits(self, seq: SequenceState, loras: set[int]) -> bool:
        """Whether `seq` may run beside the running adapters `loras` (max_loras slots)."""
        return (not seq.lora_int_id or seq.lora_int_id in loras
                or len(loras) < self.config.max_loras)

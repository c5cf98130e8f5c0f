"""The draft-model method, engine-core side: which tokens the draft model runs each step.

The draft model lives beside the target in the runner (worker/draft_runner.py) and keeps its
own KV cache in the *same* blocks: one block id addresses the target's and the draft's K/V of
the same positions, so the block manager, prefix cache, copy-on-write, swap and recompute
preemption move both at once and a block costs both models' bytes (engine/core.py sizes the
pool so). What the core tracks is how far the draft's KV goes: `Sequence.draft_num_computed`.

A step of a sequence that speculates:
- before the schedule, `propose` gives it `k` placeholder drafts (their slots are allocated and
  counted against the token budget like any draft);
- after the schedule, `draft_inputs` names the tokens the draft runs first: those the draft has
  not seen, up to and including the sequence's last token (`draft_input_ids` from
  `draft_start`, in the step plan); its last row's argmax is the first draft, then k - 1 one-token passes give
  the rest (the runner fills the placeholders before the target's forward);
- after the step, `after_step` moves `draft_num_computed` to what the draft wrote that is
  still true: the inputs, and of the drafts it ran (all but the last) the accepted ones.

The draft proposes greedily (its argmax): a point-mass proposal, verified exactly as the
n-gram method's (spec_decode/verify.py), as vLLM v1 does for its draft proposers.

Prefill chunks run through the draft in the same steps as through the target (when the step
speculates at all), so that the draft keeps up with the prompt; a decode without a proposal
(paused by the back-off, spec_decode/backoff.py) runs nothing and catches up at its next
proposal, unless its lag reaches half of `max_catchup_tokens` (the most one sequence runs in
one step). A step where speculation is off (`disable_by_batch_size`) runs no draft at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pagedllm.core.request import SequenceState
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.proposer import Proposer

# What a draft token is until the draft model has run (never a real token id: the target's
# embedding would refuse it if it ever reached the forward).
DRAFT_PLACEHOLDER = -1


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft_max_model_len: int,
                 max_catchup_tokens: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.draft_max_model_len = draft_max_model_len
        self.max_catchup_tokens = max_catchup_tokens
        # Which sequences the draft follows (the core's rule: no beams, no constrained samples).
        self.follows: Callable[[SequenceState], bool] = lambda seq: True
        self._active = False  # this step speculates (set by propose)

    def propose(self, running: Iterable[tuple[SequenceState, Any]]) -> int:
        self._active = True
        n = 0
        for seq, params in running:
            k = min(self.max_draft_len(seq, params), self.draft_max_model_len - seq.num_tokens)
            # the draft runs what it lacks up to the last token before it can propose
            lag = seq.num_tokens - min(seq.draft_num_computed, seq.num_computed_tokens)
            if k <= 0 or lag > self.max_catchup_tokens:
                continue
            seq.spec_token_ids = [DRAFT_PLACEHOLDER] * k
            n += 1
        return n

    def deactivate(self) -> None:
        """This step does not speculate: the draft runs nothing."""
        self._active = False

    def draft_inputs(self, scheduled: list[Any]) -> dict[int, tuple[int, list[int]]]:
        """seq id -> (draft_start, draft_input_ids): what the draft runs this step."""
        if not self._active:
            return {}
        out = {}
        for item in scheduled:
            seq = item.seq
            if not self.follows(seq):
                continue
            start = min(seq.draft_num_computed, item.start_pos)
            known_end = item.start_pos + len(item.token_ids) - len(item.draft_token_ids)
            # A decode without a proposal (paused by the back-off) catches up later, at its
            # next proposal, unless its lag nears what one step may run.
            if (not item.draft_token_ids and len(item.token_ids) == 1
                    and known_end - start < self.max_catchup_tokens // 2):
                seq.draft_num_computed = start
                continue
            # a proposal needs the draft to reach the last token; catch-up alone is capped
            end = known_end if item.draft_token_ids else min(known_end, start + self.max_catchup_tokens)
            if end > self.draft_max_model_len:
                continue
            seq.draft_num_computed = start
            if end > start:
                out[seq.seq_id] = (start, seq.token_ids_slice(start, end))
        return out

    def after_step(self, scheduled: list[Any], plan: Any, num_accepted: dict[int, int]) -> None:
        for item, step in zip(scheduled, plan.sequences):
            if not step.draft_input_ids or item.seq.is_finished:
                continue
            done = step.draft_start + len(step.draft_input_ids)
            if item.draft_token_ids:  # it also ran every draft but the last
                done += min(num_accepted.get(item.seq.seq_id, 0), len(item.draft_token_ids) - 1)
            item.seq.draft_num_computed = min(done, item.seq.num_computed_tokens)

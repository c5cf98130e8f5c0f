"""Speculative decoding, engine-core side: who gets proposals, and what the step taught us.

Before the schedule, `propose` gives the running decodes their draft tokens (the proposer sets
`Sequence.spec_token_ids`, which the scheduler schedules like any token) unless the batch is at
`disable_by_batch_size`, a proposal keeps missing (spec_decode/backoff.py) or a draft token
costs more than it saves at this batch size (spec_decode/step_cost.py). After the step,
`after_step` feeds the acceptance counts to the statistics, the back-off and the proposer.
"""

from __future__ import annotations

from typing import Any

from pagedllm.core.request import SequenceState
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.core.step_plan import StepPlan
from pagedllm.engine.request_state import RequestState
from pagedllm.spec_decode.backoff import DEFAULT_MIN_RATE, SpecBackoff
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.proposer import Proposer, SpecDecodeStats
from pagedllm.spec_decode.proposer_choice import make_proposer
from pagedllm.spec_decode.step_cost import StepCostModel
from pagedllm.structured_output import StructuredOutputManager


class Speculation:
    def __init__(self, spec: SpeculativeConfig, requests: dict[str, RequestState],
                 structured: StructuredOutputManager, max_model_len: int, max_num_batched_tokens: int,
                 draft_max_model_len: int | None, has_draft_model: bool) -> None:
        self.requests = requests  # the core's own dict: read, never changed here
        self.structured = structured
        self.has_draft_model = has_draft_model
        self.proposer: Proposer = make_proposer(spec, max_model_len, draft_max_model_len=draft_max_model_len,
                                                max_catchup_tokens=max_num_batched_tokens)
        self.proposer.follows = self.follows
        self.stats = SpecDecodeStats(spec.num_speculative_tokens)
        self.backoff = SpecBackoff()  # proposals that keep missing pause
        self.step_cost = StepCostModel()  # what a draft token costs here: sets the back-off's bar

    def follows(self, seq: SequenceState) -> bool:
        """Whether `seq` may get proposals: not a beam; a constrained sample (grammar,
        allowed_token_ids, bad_words) only from proposers whose tokens are known before the
        step, so that they are checked against the constraint (not a draft model's)."""
        state = self.requests.get(seq.request_id)
        if state is None or state.beam is not None:
            return False
        return state.constraint is None or not self.has_draft_model

    def propose(self, running: list[SequenceState], step: int) -> None:
        """Draft tokens for the running sequences about to decode, unless the batch is at
        `disable_by_batch_size`. Beams and constrained samples (grammars, allowed / bad
        words: their masks are per position) decode one token at a time."""
        limit = self.proposer.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            self.proposer.deactivate()
            return
        backoff = self.backoff
        rho = self.step_cost.break_even(len(running))
        backoff.min_rate = DEFAULT_MIN_RATE if rho is None else rho
        if len(backoff) > 2 * len(running) + 64:
            backoff.forget_all_but({seq.seq_id for seq in running})
        candidates = []
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1 or not seq.output_token_ids:
                continue
            if self.follows(seq) and backoff.allows(seq.seq_id, step):
                candidates.append((seq, self.requests[seq.request_id].params))
        self.proposer.propose(candidates)
        for seq, _ in candidates:  # a draft the constraint refuses ends the proposal
            constraint = self.requests[seq.request_id].constraint
            if constraint is not None and seq.spec_token_ids:
                n = self.structured.valid_draft_prefix(constraint, seq.grammar, seq.output_token_ids,
                                                       seq.spec_token_ids)
                del seq.spec_token_ids[n:]

    def observe_step_time(self, plan: StepPlan, seconds: float) -> None:
        """A step of decodes only (with or without drafts) teaches the step-cost model."""
        if all(len(s.token_ids) == 1 + len(s.draft_token_ids) for s in plan.sequences):
            self.step_cost.observe(plan.num_batched_tokens, seconds)

    def observe_verified(self, seq_id: int, num_drafts: int, accepted: int, step: int) -> None:
        self.stats.observe(num_drafts, accepted)
        self.backoff.observe(seq_id, accepted, num_drafts, step)

    def after_step(self, sched_out: SchedulerOutput, plan: StepPlan, num_accepted: dict[int, int]) -> None:
        self.proposer.after_step(sched_out.scheduled, plan, num_accepted)

    def stats_fields(self) -> dict[str, Any]:
        """CoreStats' speculative decoding counters (vllm:spec_decode_* on /metrics)."""
        st = self.stats
        return dict(spec_num_drafts=st.num_drafts, spec_num_draft_tokens=st.num_draft_tokens,
                    spec_num_accepted_tokens=st.num_accepted_tokens,
                    spec_accepted_per_pos=list(st.accepted_per_pos))

"""The step plan's assembly: the scheduler's decision plus what only the engine core knows.

`StepPlanner.plan` turns a `SchedulerOutput` into the frozen `StepPlan` (core/step_plan.py)
the runners execute: per sequence its tokens and table deltas (the scheduler's), whether every
row's logits come back (prompt logprobs: the request's), what a draft model runs first (the
proposer's); for the step the grammar masks (submitted now, filled on a worker thread while the
forward runs), the LoRA adapters the sequences use, and the sampling rows of sequences made
since the previous plan. Nothing is added to a plan after it is made.
"""

from __future__ import annotations

from typing import Any

from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.core.step_plan import SequenceStep, StepPlan
from pagedllm.engine.request_state import RequestState
from pagedllm.lora.core_registry import CoreLoRAs
from pagedllm.multimodal.mrope import chunk_positions
from pagedllm.spec_decode.proposer import Proposer
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.worker.input_batch import SamplingRowSpec


class StepPlanner:
    def __init__(self, requests: dict[str, RequestState], structured: StructuredOutputManager,
                 proposer: Proposer | None, loras: CoreLoRAs | None) -> None:
        self.requests = requests  # the core's own dict: read, never changed here
        self.structured = structured
        self.proposer = proposer
        self.loras = loras
        self._new_rows: list[SamplingRowSpec] = []  # rows no runner has been given yet

    def add_sampling_row(self, spec: SamplingRowSpec) -> None:
        """A new sequence's sampling row: it goes to the runner with the next plan."""
        self._new_rows.append(spec)

    def plan(self, sched_out: SchedulerOutput) -> StepPlan:
        scheduled = sched_out.scheduled
        drafts = self.proposer.draft_inputs(scheduled) if self.proposer is not None and scheduled else {}
        steps = []
        for item in scheduled:
            state = self.requests[item.seq.request_id]
            if state.pooling is not None:
                steps.append(sequence_step(item, pool=True, token_type_ids=state.pooling.token_type_ids))
                continue
            steps.append(sequence_step(
                item, state.num_prompt_logprobs is not None and not state.prompt_logprobs_done,
                *drafts.get(item.seq.seq_id, (0, []))))
        rows, self._new_rows = self._new_rows, []
        return plan_of(
            sched_out, steps,
            lora_requests=self.loras.requests_of(scheduled) if self.loras is not None else {},
            new_sampling_rows=rows,
            # The masks depend only on tokens already accepted: filled while the forward runs.
            token_masks=self.structured.submit_masks(self._mask_entries(scheduled)) if scheduled else None,
        )

    def _mask_entries(self, scheduled: list[Any]) -> list:
        """(seq id, constraint, matcher, output ids, drafts) of the constrained sequences that
        sample this step: the runner's sampler waits for their rows after the forward."""
        entries = []
        for item in scheduled:
            if not item.sample:
                continue
            state = self.requests[item.seq.request_id]
            if state.constraint is not None and state.beam is None:
                entries.append((item.seq.seq_id, state.constraint, item.seq.grammar,
                                item.seq.output_token_ids, item.draft_token_ids))
        return entries


def sequence_step(item: ScheduledSequence, all_logits: bool = False, draft_start: int = 0,
                  draft_input_ids: list[int] | None = None, pool: bool = False,
                  token_type_ids: list[int] | None = None) -> SequenceStep:
    """The runner's part of one scheduled sequence."""
    mrope, delta = chunk_positions(item.seq.mm_features, item.start_pos, len(item.token_ids),
                                   item.seq.prompt_len) if item.seq.mm_features else ([], 0)
    return SequenceStep(item.seq.seq_id, item.token_ids, item.start_pos, item.blocks_from, item.new_block_ids,
                        item.sample, all_logits, item.seq_len, item.group_deltas, item.draft_token_ids,
                        draft_start, draft_input_ids or [], item.lora_int_id, pool, token_type_ids or [],
                        item.mm_runs, mrope, delta)


def plan_of(sched_out: SchedulerOutput, steps: list[SequenceStep] | None = None, **engine_parts: Any) -> StepPlan:
    """A plan of the scheduler's decision (its sequences as they are, unless `steps` are
    given) with the engine's parts named by keyword (masks, adapters, sampling rows)."""
    if steps is None:
        steps = [sequence_step(item) for item in sched_out.scheduled]
    return StepPlan(steps, sched_out.num_batched_tokens, sched_out.block_copies, sched_out.blocks_to_swap_out,
                    sched_out.blocks_to_swap_in, sched_out.released_seq_ids, sched_out.finished_seq_ids,
                    encoder_inputs=sched_out.encoder_inputs, freed_encoder_hashes=sched_out.freed_encoder_hashes,
                    **engine_parts)

"""How a request's sequences are made: its first one (a beam, or sample 0 with its sampling
row and the seq ids its n > 1 forks will have), the forks at its first sample, the beams chosen
twice. A fork shares its parent's blocks (ref counts raised; copy-on-write before it writes a
shared block)."""

from __future__ import annotations

import itertools
from typing import Any

from pagedllm.core.request import SequenceState
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.beam_search import BeamSearch, BeamSearchRequest
from pagedllm.engine.core_messages import EngineCoreRequest
from pagedllm.engine.request_state import RequestState
from pagedllm.engine.step_planner import StepPlanner
from pagedllm.lora.core_registry import lora_cache_key
from pagedllm.lora.request import LoRARequest
from pagedllm.worker.input_batch import SamplingRowSpec


class SequenceMaker:
    def __init__(self, scheduler: Scheduler, planner: StepPlanner, eos_token_ids: set[int]) -> None:
        self.scheduler = scheduler
        self.planner = planner  # sample 0's sampling row goes with the next plan
        self.eos_token_ids = eos_token_ids
        self._ids = itertools.count()  # seq ids, unique in the core

    def new_request_state(self, request: EngineCoreRequest, prompt_ids: list[int], beam_params: Any,
                          constraint: Any, lora: LoRARequest | None) -> RequestState:
        """The request's state and its first sequence (a beam, or sample 0)."""
        params = request.sampling_params
        request_id = request.request_id
        state = RequestState(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            arrival_time=request.arrival_time,
            num_prompt_logprobs=0 if params.prompt_logprobs is not None else None,
            priority=request.priority,
            constraint=constraint,
            lora_request=lora,
            mm_features=tuple(request.mm_features or ()),
        )
        if beam_params is not None:
            seq = self.new_beam(state, request.cache_salt, [])
            stop_ids = self.eos_token_ids | set(params.stop_token_ids)
            state.beam = BeamSearchRequest(BeamSearch(beam_params, stop_ids), running=[seq])
        else:
            seq = self.new_sample(state, cache_salt=request.cache_salt)
        if params.prompt_logprobs is not None:
            seq.skip_prefix_cache = True
        state.seqs.append(seq)
        return state

    def new_beam(
        self, state: RequestState, cache_salt: str | None, output_token_ids: list[int]
    ) -> SequenceState:
        """A beam: no sampling row (beam search chooses its tokens itself)."""
        return self.make(state, 0, cache_salt, output_token_ids)

    def make(
        self, state: RequestState, index: int, cache_salt: str | None,
        output_token_ids: list[int] = (), seq_id: int | None = None,
    ) -> SequenceState:
        lora = state.lora_request
        return SequenceState(
            seq_id=next(self._ids) if seq_id is None else seq_id,
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            arrival_time=state.arrival_time,
            index=index,
            cache_salt=cache_salt,
            priority=state.priority,
            output_token_ids=list(output_token_ids),
            lora_int_id=0 if lora is None else lora.lora_int_id,
            lora_key=None if lora is None else lora_cache_key(lora),
            mm_features=state.mm_features,
        )

    def new_sample(self, state: RequestState, cache_salt: str | None) -> SequenceState:
        """Sample 0 of a sampled request; its row goes to the runner with the next step, with
        the seq ids its n > 1 forks will have."""
        params = state.params
        seq = self.make(state, 0, cache_salt)
        seq.grammar = state.constraint.new_matcher() if state.constraint else None
        state.fork_seq_ids = [next(self._ids) for _ in range(1, params.n)]
        blocked = frozenset(params.stop_token_ids) | params.all_stop_token_ids | self.eos_token_ids
        self.planner.add_sampling_row(SamplingRowSpec(
            seq.seq_id, params, 0, state.prompt_token_ids,
            min_tokens_blocked=blocked if params.min_tokens else frozenset(),
            fork_seq_ids=list(state.fork_seq_ids)))
        return seq

    def fork_sample(self, state: RequestState, parent: SequenceState, idx: int) -> SequenceState:
        """Sample `idx` of an n > 1 request, made at the first sample with the seq id the
        runner's fork row has: it shares the parent's blocks (ref counts raised; copy-on-write
        before it writes a shared block)."""
        child = self.make(state, idx, parent.cache_salt,
                                    seq_id=state.fork_seq_ids[idx - 1])
        child.grammar = state.constraint.new_matcher() if state.constraint else None
        child.num_computed_tokens = parent.num_computed_tokens
        child.draft_num_computed = parent.draft_num_computed  # the shared blocks hold its K/V too
        self.scheduler.fork_sequence(parent, child)
        state.seqs.append(child)
        return child

    def fork_beam(self, state: RequestState, parent: SequenceState) -> SequenceState:
        """A beam chosen twice: the copy shares every block of its parent (CoW on write)."""
        child = self.new_beam(state, parent.cache_salt, parent.output_token_ids)
        self.scheduler.fork_sequence(parent, child)
        return child

"""Engine-core state of a request: its sequences, prompt-logprob progress, beams, constraint.

core/ keeps the token streams and cache positions (`SequenceState`, one per sample); the runner's
persistent batch (worker/input_batch.py) keeps each sample's sampling state (parameters,
generator, penalty counts). Text lives in the front end (`engine/output_processor.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.core.request import SequenceState
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.beam_search import BeamSearchRequest
    from pagedllm.structured_output import RequestConstraint
    from pagedllm.engine.core_messages import BeamCompletion
    from pagedllm.engine.core_pooling import PoolingState


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | None  # None: a pooling request (`pooling`)
    arrival_time: float
    seqs: list[SequenceState] = field(default_factory=list)
    priority: int = 0  # the request's scheduling priority (lower = earlier)
    # Prompt logprobs: how many positions were reported (None: not asked for).
    num_prompt_logprobs: int | None = None
    prompt_logprobs_done: bool = False
    forked: bool = False
    # Beam search: the running beams' state, and the final hypotheses once it is done.
    beam: BeamSearchRequest | None = None
    beam_outputs: list[BeamCompletion] | None = None
    first_scheduled_time: float | None = None
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache
    # structured outputs / allowed_token_ids / bad_words, compiled at add_request
    constraint: RequestConstraint | None = None
    # n > 1: the seq ids of samples 1 .. n-1, reserved at add_request; the runner makes their
    # sampling rows and the core their sequences at the first sample.
    fork_seq_ids: list[int] = field(default_factory=list)
    # Multi-LoRA: the adapter every sequence of the request runs with (None: the base model).
    lora_request: Any = None
    mm_features: tuple[Any, ...] = ()  # the prompt's images (multimodal/inputs.py)
    # A pooling request (engine/core_pooling.py): its parameters and the rows pooled so far.
    pooling: PoolingState | None = None

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.search.done or all(s.is_finished for s in self.seqs)
        return all(s.is_finished for s in self.seqs) and (
            self.params is None or self.forked or self.params.n == 1)

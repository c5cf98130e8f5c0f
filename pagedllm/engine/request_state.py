"""Engine-core state of a request: its sequences, their generators and logprob flags.

core/ keeps the token streams and cache positions (`Sequence`); this module keeps what the
engine core needs besides them to sample and to report each step's new tokens. Text lives in
the front end (`engine/output_processor.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.core.request import Sequence
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.beam_search import BeamSearchRequest
    from pagedllm.structured_output import RequestConstraint
    from pagedllm.engine.core_messages import BeamCompletion

_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


def sample_seed(request_seed: int, index: int) -> int:
    """Seed of sample `index` of a request: the request's own for index 0, then mixed."""
    if index == 0:
        return request_seed
    return (request_seed ^ (index * _SEED_MIX)) & _SEED_MASK


@dataclass
class SeqState:
    """What the core tracks per sequence besides its tokens."""

    generator: torch.Generator | None
    wants_logprobs: bool
    stop_reason: int | None = None
    finish_reason: str | None = None
    reported: bool = False  # its finish was sent to the front end
    # structured outputs: this sample's xgrammar GrammarMatcher (each sample its own), advanced
    # by every accepted token; dropped when the sequence finishes
    matcher: Any = None
    # penalties: the output token counts and prompt token set, kept across steps
    # (layers/sampler.PenaltyCounts); made at the first step that needs them
    penalty_counts: Any = None


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
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

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.search.done or all(s.is_finished for s in self.seqs)
        return all(s.is_finished for s in self.seqs) and (self.forked or self.params.n == 1)

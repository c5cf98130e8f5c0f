"""Engine-side state of a request: its sequences, their detokenizers, generators and logprobs.

core/ keeps the token streams and cache positions (`Sequence`); this module keeps what only the
engine needs to turn sampled tokens into a `RequestOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.core.request import Sequence
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from pagedllm.engine.beam_search import BeamSearchRequest

_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


def sample_seed(request_seed: int, index: int) -> int:
    """Seed of sample `index` of a request: the request's own for index 0, then mixed."""
    if index == 0:
        return request_seed
    return (request_seed ^ (index * _SEED_MIX)) & _SEED_MASK


@dataclass
class SeqState:
    """What the engine tracks per sequence besides its tokens."""

    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    text: str = ""  # output text, truncated at a stop string
    stop_reason: int | str | None = None
    finish_reason: str | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_done: bool = False
    forked: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # Beam search: the running beams' state, and the final hypotheses once it is done.
    beam: BeamSearchRequest | None = None
    beam_outputs: list[CompletionOutput] | None = None
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.search.done or all(s.is_finished for s in self.seqs)
        return all(s.is_finished for s in self.seqs) and (self.forked or self.params.n == 1)

    def to_output(self) -> RequestOutput:
        if self.beam is not None:
            return self._output(self.beam_outputs or [])
        completions = []
        for seq in sorted(self.seqs, key=lambda s: s.index):
            st: SeqState = seq.data["state"]
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=st.text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=st.cumulative_logprob if st.logprobs is not None else None,
                    logprobs=st.logprobs,
                    finish_reason=st.finish_reason,
                    stop_reason=st.stop_reason,
                )
            )
        return self._output(completions)

    def _output(self, completions: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=completions,
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
        )

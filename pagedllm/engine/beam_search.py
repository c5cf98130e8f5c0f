"""Beam search with transformers' semantics, one request at a time.

`BeamSearch.step` reproduces `GenerationMixin._beam_search` (transformers 4.5x / 5.x) for one
prompt, so that results equal `generate(num_beams=w, do_sample=False, length_penalty=...,
early_stopping=...)`:

- candidates: the top `(1 + number of stop ids) * w` of (beam score + token logprob) over all
  running beams; scores are float32 sums of log_softmax rows, as there;
- a candidate "hits" when its token is a stop id or the generated length reaches max_tokens;
  among the best `w` candidates, the hits become finished hypotheses scored
  `sum_logprobs / generated_len ** length_penalty` (generated_len counts the stop token);
  the finished set keeps the best `w`;
- the next running beams are the best `w` candidates that did not hit;
- the search ends when no candidate may continue, when `early_stopping is True` and `w`
  hypotheses are finished, or when the best running score (at the current length, or at
  max_tokens for "never" with length_penalty > 0) cannot beat the worst finished one.

The KV side (beams sharing blocks, forks, frees) is the engine's; this module only chooses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.engine.core_messages import BeamCompletion
from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.request_state import RequestState


@dataclass
class BeamHypothesis:
    token_ids: list[int]  # generated tokens, the stop token included
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" or "length"


@dataclass
class BeamContinuation:
    parent: int  # index of the running beam it extends
    token_id: int


@dataclass
class BeamStep:
    continuations: list[BeamContinuation]  # the next running beams, best first (none if done)
    done: bool


class BeamSearch:
    def __init__(self, params: BeamSearchParams, stop_token_ids: set[int]) -> None:
        self.width = params.beam_width
        self.max_tokens = params.max_tokens
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.temperature = params.temperature
        self.stop_token_ids = set() if params.ignore_eos else set(stop_token_ids)
        self.running_scores = torch.zeros(1, dtype=torch.float32)  # one beam: the prompt
        self.finished: list[BeamHypothesis] = []  # best first, at most `width`
        self.num_generated = 0
        self.done = False

    def step(self, logits: torch.Tensor, running_tokens: list[list[int]]) -> BeamStep:
        """One token for every running beam: `logits[i]` is beam i's last row."""
        if self.done:
            raise RuntimeError("the beam search has already finished")
        w = self.width
        logits = logits.float().cpu()
        if self.temperature > 0.0 and self.temperature != 1.0:
            logits = logits / self.temperature
        acc = torch.log_softmax(logits, dim=-1) + self.running_scores[:, None]
        vocab = acc.shape[-1]
        k = min(max(2, 1 + len(self.stop_token_ids)) * w, acc.numel())
        top_lp, top_idx = torch.topk(acc.reshape(-1), k)
        parents = (top_idx // vocab).tolist()
        tokens = (top_idx % vocab).tolist()
        gen_len = self.num_generated + 1
        at_length = gen_len >= self.max_tokens
        hits = [at_length or t in self.stop_token_ids for t in tokens]

        # Finished hypotheses: only hits among the best `w` candidates count.
        cand_scores = (top_lp / (gen_len**self.length_penalty)).tolist()
        top_lps = top_lp.tolist()
        for j in range(min(w, k)):
            if hits[j]:
                self.finished.append(
                    BeamHypothesis(
                        token_ids=running_tokens[parents[j]] + [tokens[j]],
                        cumulative_logprob=top_lps[j],
                        score=cand_scores[j],
                        finish_reason="length" if tokens[j] not in self.stop_token_ids else "stop",
                    )
                )
        self.finished.sort(key=lambda h: h.score, reverse=True)  # stable: earlier first on ties
        del self.finished[w:]

        keep = [j for j in range(k) if not hits[j]][:w]
        self.num_generated = gen_len
        self.running_scores = top_lp[keep] if keep else torch.zeros(0)
        self.done = not keep or self._should_stop()
        if self.done:
            return BeamStep([], True)
        return BeamStep([BeamContinuation(parents[j], tokens[j]) for j in keep], False)

    def _should_stop(self) -> bool:
        full = len(self.finished) >= self.width
        if not full:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_tokens
        else:
            best_len = self.num_generated
        best_possible = (self.running_scores[:1] / (best_len**self.length_penalty)).item()
        return best_possible <= self.finished[-1].score

    def results(self) -> list[BeamHypothesis]:
        return list(self.finished)


@dataclass
class BeamSearchRequest:
    """A beam request's running beams and the logits rows they have produced so far.

    A beam waits (its tokens all computed) until every running beam of the request has its
    row: beams may be scheduled in different steps, recomputed or swapped out meanwhile.
    """

    search: BeamSearch
    running: list[SequenceState]
    pending: dict[int, torch.Tensor] = field(default_factory=dict)

    def add_logits(self, seq: SequenceState, row: torch.Tensor) -> None:
        self.pending[seq.seq_id] = row

    def ready(self) -> bool:
        return all(
            s.seq_id in self.pending
            and s.status == SequenceStatus.RUNNING
            and s.num_computed_tokens == s.num_tokens
            for s in self.running
        )

    def take_logits(self) -> torch.Tensor:
        rows = [self.pending.pop(s.seq_id) for s in self.running]
        self.pending.clear()
        return torch.stack(rows)

    def advance(
        self, fork: Callable[[SequenceState], SequenceState], drop: Callable[[SequenceState], None]
    ) -> bool:
        """One beam step on the sequences; returns True when the search is done.

        A beam chosen once keeps its sequence; chosen again, it is forked first (the copy
        shares all its blocks); a beam not chosen is dropped (its blocks are freed). Forks are
        made before any token is appended, so each copy starts from its parent's tokens.
        """
        parents = self.running
        step = self.search.step(self.take_logits(), [s.output_token_ids for s in parents])
        kept: set[int] = set()
        chosen: list[tuple[SequenceState, int]] = []
        for c in step.continuations:
            parent = parents[c.parent]
            if parent.seq_id in kept:
                chosen.append((fork(parent), c.token_id))
            else:
                kept.add(parent.seq_id)
                chosen.append((parent, c.token_id))
        for parent in parents:
            if parent.seq_id not in kept:
                drop(parent)
        for seq, token_id in chosen:
            seq.append_token(token_id)
        self.running = [seq for seq, _ in chosen]
        return step.done


def beam_completions(
    hypotheses: list[BeamHypothesis], state: RequestState, eos_token_ids: set[int]
) -> list[BeamCompletion]:
    """The finished hypotheses, best first, as the request's completions (token ids: the
    front end decodes them)."""
    params = state.params
    out = []
    for i, hyp in enumerate(hypotheses):
        tokens = hyp.token_ids
        num_text = len(tokens)
        if hyp.finish_reason == "stop" and not params.include_stop_str_in_output:
            num_text -= 1  # the stop token's text is not part of the output
        last = tokens[-1]
        out.append(
            BeamCompletion(
                index=i,
                token_ids=list(tokens),
                num_text_tokens=num_text,
                cumulative_logprob=hyp.cumulative_logprob,
                finish_reason=hyp.finish_reason,
                stop_reason=last
                if hyp.finish_reason == "stop" and last not in eos_token_ids
                else None,
            )
        )
    return out


_BEAM_UNSUPPORTED = {
    "stop": [],
    "logprobs": None,
    "prompt_logprobs": None,
    "min_tokens": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "logit_bias": None,
}


def beam_params_from_sampling(params: SamplingParams, max_tokens: int) -> BeamSearchParams:
    """The beam search a `SamplingParams(use_beam_search=True, n=w)` asks for."""
    for name, default in _BEAM_UNSUPPORTED.items():
        if getattr(params, name) != default:
            raise ValueError(f"{name} is not supported with beam search (use_beam_search=True).")
    return BeamSearchParams(
        beam_width=params.n,
        max_tokens=max_tokens,
        ignore_eos=params.ignore_eos,
        temperature=params.temperature,
        length_penalty=params.length_penalty,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )


def sampling_params_from_beam(params: BeamSearchParams) -> SamplingParams:
    """The engine-side SamplingParams of an `LLM.beam_search` request."""
    return SamplingParams(
        n=params.beam_width,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        temperature=params.temperature,
        length_penalty=params.length_penalty,
        include_stop_str_in_output=params.include_stop_str_in_output,
        use_beam_search=True,
    )

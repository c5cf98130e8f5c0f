"""What a request returns, mirroring vLLM's `RequestOutput` / `CompletionOutput` / `Logprob`.

A `RequestOutput` holds the prompt, its token ids (and prompt logprobs if asked for) and one
`CompletionOutput` per sample (`n`). Log-probabilities are kept per position as
`dict[token_id, Logprob]`: the chosen token plus the top-k most likely ones. This module imports
no torch.
"""

from __future__ import annotations

from typing import Any

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class Logprob:
    """The log-probability of one token at one position.

    rank: 1 for the most likely token of the vocabulary, 2 for the next, ...
    decoded_token: the token's text (filled by the engine), or None.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: {token_id: Logprob} for the sampled token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token; the first entry is None (nothing predicts the first token).
PromptLogprobs = list[dict[int, Logprob] | None]


def make_logprob_dict(
    token_id: int,
    logprob: float,
    rank: int | None,
    top_logprobs: Sequence[tuple[int, float]] = (),
    decode: Callable[[int], str] | None = None,
) -> dict[int, Logprob]:
    """Builds one position's dict: the chosen token first, then the top-k in rank order (the
    chosen token appears once even when it is among the top-k). `decode(token_id)` fills
    `decoded_token` when given."""
    out = {token_id: Logprob(logprob, rank, decode(token_id) if decode else None)}
    for i, (tid, lp) in enumerate(top_logprobs):
        if tid not in out:
            out[tid] = Logprob(lp, i + 1, decode(tid) if decode else None)
    return out


@dataclass
class CompletionOutput:
    """One sample of a request.

    finish_reason: None while running; "stop" (EOS, stop token or stop string), "length"
        (max_tokens / max_model_len) or "abort".
    stop_reason: the stop string or stop token id that ended the sample; None for EOS, length
        and unfinished.
    cumulative_logprob: sum of the sampled tokens' logprobs (None unless logprobs were asked
        for).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={_short_logprobs(self.logprobs)}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestMetrics:
    """Timestamps (time.time() seconds) and counts for one request; unset fields are None."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None  # first_scheduled_time - arrival_time
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    # vLLM's request phases (vllm:request_{prefill,decode,inference}_time_seconds): prefill
    # runs from the first scheduling to the first token, decode from there to the last token.
    @property
    def prefill_time(self) -> float | None:
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def inference_time(self) -> float | None:
        if self.first_scheduled_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_scheduled_time


@dataclass
class RequestOutput:
    """The output of one request: the prompt and its `n` completions so far.

    num_cached_tokens: prompt tokens found in the prefix cache (None if unknown).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None
    lora_request: Any = None  # the LoRA adapter it ran with (lora/request.LoRARequest), as vLLM's

    def add(self, newer: "RequestOutput") -> None:
        """Fold a later DELTA output into this unread one (a slow reader gets one output
        holding both): texts, token ids and logprobs appended per completion index, the rest
        taken from `newer`."""
        by_index = {c.index: c for c in self.outputs}
        for c in newer.outputs:
            mine = by_index.get(c.index)
            if mine is None:
                self.outputs.append(c)
                by_index[c.index] = c
                continue
            mine.text += c.text
            mine.token_ids = mine.token_ids + c.token_ids
            if c.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + c.logprobs
            mine.cumulative_logprob = c.cumulative_logprob
            mine.finish_reason, mine.stop_reason = c.finish_reason, c.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.prompt_logprobs = newer.prompt_logprobs
        self.finished = newer.finished
        self.metrics = newer.metrics
        self.num_cached_tokens = newer.num_cached_tokens

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={_short_list(self.prompt_token_ids)}, "
            f"prompt_logprobs={_short_logprobs(self.prompt_logprobs)}, "
            f"outputs={self.outputs}, finished={self.finished}, metrics={self.metrics}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )


def _short_list(xs: list | None, limit: int = 32) -> str:
    if xs is None or len(xs) <= limit:
        return repr(xs)
    return f"[{', '.join(map(repr, xs[:limit]))}, ... ({len(xs)} total)]"


def _short_logprobs(lps: list | None) -> str:
    if lps is None:
        return "None"
    return f"<{len(lps)} positions>"

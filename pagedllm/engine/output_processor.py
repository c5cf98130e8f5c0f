"""The front end's half of the engine: token deltas from the core -> `RequestOutput`s.

Per request it keeps what the client sees: each sample's tokens, its incremental detokenizer
and text, its logprobs with decoded tokens, the prompt logprobs, the timings. Stop strings are
checked here, on the text (the core never sees text): a sample they end is finished at once
and reported in `ProcessedOutputs.finish_samples`, which the caller passes to the core
(`EngineCore.finish_samples`) so that its blocks return. Tokens the core produced for a sample
after that (it may be a step or two ahead when it runs in another process) are ignored, so the
output is the same wherever the core runs.

What a request's outputs hold is its `SamplingParams.output_kind`, as in vLLM:
- CUMULATIVE: everything so far, every time (each output copies the token lists);
- DELTA (the server's streams): only what is new since the previous output, text that may
  still become a stop string held back (`num_held_back_chars`; it goes out with a later delta
  or never), so the deltas concatenate to the final text; nothing is copied per step;
- FINAL_ONLY (offline `LLM`, the server's plain responses): one output, when it finishes.
Whatever the kind, `ProcessedOutputs.step_stats` says what each request did in the step, for
the metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.core_messages import EngineCoreOutput, PromptLogprobEntry, SampleDelta
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    make_logprob_dict,
)
from pagedllm.pooling.outputs import PoolingRequestOutput, pooling_output
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import (
    IncrementalDetokenizer,
    check_stop_strings,
    decode_stream_backend,
    num_held_back_chars,
)


@dataclass
class SampleState:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""  # truncated at a stop string
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # DELTA: what earlier outputs carried
    sent_tokens: int = 0
    sent_chars: int = 0
    finish_sent: bool = False


@dataclass
class RequestOutputState:
    request_id: str  # what the caller knows it by (RequestOutput.request_id)
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | None  # None: a pooling request
    metrics: RequestMetrics
    is_beam: bool
    samples: dict[int, SampleState] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None
    beam_outputs: list[CompletionOutput] | None = None
    finished: bool = False
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    held_stop: list[str] = field(default_factory=list)  # DELTA: stop strings to hold back
    lora_request: Any = None  # reported on its RequestOutputs
    pooled: bytes | None = None  # a pooling request's vector (float32), once the core sent it


@dataclass
class RequestStepStats:
    """What one request did in a step, for the metrics, whatever its outputs hold."""

    request_id: str  # the caller's id
    prompt_len: int
    num_cached_tokens: int | None
    metrics: RequestMetrics
    longest: int  # tokens of its longest sample (or beam) so far
    finished: bool
    finish_reason: str | None


@dataclass
class ProcessedOutputs:
    # (core request id, output) for every request that advanced
    request_outputs: list[tuple[str, RequestOutput]] = field(default_factory=list)
    # (request id, sample index) that a stop string ended and the core may still be running
    finish_samples: list[tuple[str, int]] = field(default_factory=list)
    # (request id, error text, kind) the core failed: "invalid" / "stall" / "internal"
    errors: list[tuple[str, str, str]] = field(default_factory=list)
    # every request that advanced or finished, even those whose kind sends nothing now
    step_stats: list[RequestStepStats] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        if tokenizer is not None:
            decode_stream_backend(tokenizer)  # decided now, not at a request's first token
        self.requests: dict[str, RequestOutputState] = {}
        self._decoded: dict[int, str] = {}

    def decode_token(self, token_id: int) -> str:
        text = self._decoded.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._decoded[token_id] = text
        return text

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
        params: SamplingParams, arrival_time: float, is_beam: bool = False,
        external_id: str | None = None, lora_request: Any = None,
    ) -> None:
        """`request_id` is the core's id of the request; `external_id` (default: the same) is
        the id its outputs carry."""
        if request_id in self.requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        self.requests[request_id] = RequestOutputState(
            request_id=external_id if external_id is not None else request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=arrival_time,
                                   num_prompt_tokens=len(prompt_token_ids)),
            is_beam=is_beam,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            kind=params.output_kind,
            held_stop=list(params.stop) if (params.output_kind is RequestOutputKind.DELTA
                                            and params.stop
                                            and not params.include_stop_str_in_output) else [],
            lora_request=lora_request,
        )

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int], arrival_time: float,
                            external_id: str | None = None) -> None:
        """A pooling model's request: one `PoolingRequestOutput` when the core finishes it."""
        if request_id in self.requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        self.requests[request_id] = RequestOutputState(
            external_id if external_id is not None else request_id, None, prompt_token_ids, None,
            RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids)), False,
            kind=RequestOutputKind.FINAL_ONLY)

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    # ---- processing -----------------------------------------------------------------------

    def process_outputs(
        self, outputs: list[EngineCoreOutput], now: float | None = None
    ) -> ProcessedOutputs:
        result = ProcessedOutputs()
        now = time.time() if now is None else now
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue  # aborted or finished here already (a stop string)
            if out.error is not None:
                del self.requests[out.request_id]
                result.errors.append((out.request_id, out.error, out.error_kind or "internal"))
                continue
            m = state.metrics
            if out.first_scheduled_time is not None:
                m.first_scheduled_time = out.first_scheduled_time
                m.time_in_queue = out.first_scheduled_time - m.arrival_time
                state.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs:
                self._add_prompt_logprobs(state, out.new_prompt_logprobs)
            advanced = False
            for delta in out.samples:
                if self._apply_delta(state, out.request_id, delta, result):
                    advanced = True
            if out.beam_completions is not None:
                state.beam_outputs = self._beam_outputs(state, out)
                advanced = True
            if out.pooled is not None:
                state.pooled = out.pooled
            if advanced:
                if m.first_token_time is None:
                    m.first_token_time = now
                m.last_token_time = now
                m.num_generation_tokens = (
                    sum(len(c.token_ids) for c in state.beam_outputs) if state.beam_outputs
                    else sum(len(s.token_ids) for s in state.samples.values())
                )
            if out.finished or self._all_samples_finished(state):
                state.finished = True
            if advanced or state.finished:
                if state.finished:
                    m.finished_time = now
                    del self.requests[out.request_id]
                result.step_stats.append(self._step_stats(state))
                output = self._to_output(state)
                if output is not None:
                    result.request_outputs.append((out.request_id, output))
        return result

    def _step_stats(self, state: RequestOutputState) -> RequestStepStats:
        if state.beam_outputs:
            longest = max(len(c.token_ids) for c in state.beam_outputs)
            reason = state.beam_outputs[0].finish_reason
        else:
            longest = max((len(s.token_ids) for s in state.samples.values()), default=0)
            first = state.samples.get(0)
            reason = first.finish_reason if first is not None else None
            if state.pooled is not None:
                reason = "stop"  # vLLM's finished_reason for a pooled request
        return RequestStepStats(state.request_id, len(state.prompt_token_ids),
                                state.num_cached_tokens, state.metrics, longest,
                                state.finished, reason)

    def _sample(self, state: RequestOutputState, index: int) -> SampleState:
        sample = state.samples.get(index)
        if sample is None:
            params = state.params
            sample = state.samples[index] = SampleState(
                index=index,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, state.prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                ),
                logprobs=[] if params.logprobs is not None else None,
            )
        return sample

    def _apply_delta(
        self, state: RequestOutputState, core_id: str, delta: SampleDelta,
        result: ProcessedOutputs,
    ) -> bool:
        """Append a sample's new tokens; True if it gained any."""
        sample = self._sample(state, delta.index)
        if sample.finish_reason is not None:
            return False  # a stop string ended it; the core ran ahead
        params = state.params
        if not delta.new_token_ids:  # an end without a token (an abort): only the reason
            if delta.finish_reason is None:
                return False
            sample.finish_reason, sample.stop_reason = delta.finish_reason, delta.stop_reason
            return True
        last = len(delta.new_token_ids) - 1
        for i, token in enumerate(delta.new_token_ids):
            sample.token_ids.append(token)
            if sample.logprobs is not None and delta.new_logprobs is not None:
                tid, lp, rank, top = delta.new_logprobs[i]
                sample.cumulative_logprob += lp
                sample.logprobs.append(make_logprob_dict(
                    tid, lp, rank, top, self.decode_token if params.detokenize else None))
            core_reason = delta.finish_reason if i == last else None
            # A stop token's own text is not part of the output (unless asked for);
            # detokenize=False: token ids only, no text (SamplingParams refuses stop strings).
            by_token = core_reason == "stop"
            if params.detokenize and (not by_token or params.include_stop_str_in_output):
                text_delta = sample.detokenizer.add_token(token)
                sample.text = sample.detokenizer.text
                if (not by_token and params.stop
                        and len(sample.token_ids) >= params.min_tokens):
                    hit = check_stop_strings(sample.text, len(text_delta), params.stop,
                                             params.include_stop_str_in_output)
                    if hit is not None:
                        stop_str, truncate_to = hit
                        sample.text = sample.text[:truncate_to]
                        sample.finish_reason, sample.stop_reason = "stop", stop_str
                        if core_reason is None:  # the core would go on: tell it
                            result.finish_samples.append((core_id, delta.index))
                        return True
            if core_reason is not None:
                sample.finish_reason, sample.stop_reason = core_reason, delta.stop_reason
        return True

    def _all_samples_finished(self, state: RequestOutputState) -> bool:
        if state.is_beam or state.params is None:
            return False  # a beam search or a pooling request ends with the core's final output
        samples = state.samples
        return len(samples) >= state.params.n and all(
            s.finish_reason is not None for s in samples.values()
        )

    def _add_prompt_logprobs(
        self, state: RequestOutputState, entries: list[PromptLogprobEntry]
    ) -> None:
        for entry in entries:
            if entry is None:
                state.prompt_logprobs.append(None)
                continue
            state.prompt_logprobs.append({
                tid: Logprob(lp, rank, self.decode_token(tid)) for tid, (lp, rank) in entry.items()
            })

    def _beam_outputs(
        self, state: RequestOutputState, out: EngineCoreOutput
    ) -> list[CompletionOutput]:
        params = state.params
        completions = []
        for hyp in out.beam_completions:
            detok = IncrementalDetokenizer(
                self.tokenizer, state.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
            detok.add_tokens(hyp.token_ids[: hyp.num_text_tokens])
            completions.append(CompletionOutput(
                index=hyp.index, text=detok.text, token_ids=list(hyp.token_ids),
                cumulative_logprob=hyp.cumulative_logprob, finish_reason=hyp.finish_reason,
                stop_reason=hyp.stop_reason,
            ))
        return completions

    def _to_output(self, state: RequestOutputState) -> RequestOutput | PoolingRequestOutput | None:
        """The output the request's kind asks for now; None: nothing to send yet."""
        if state.kind is RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        if state.params is None:
            return pooling_output(state.request_id, state.pooled, state.prompt_token_ids)
        if state.is_beam:
            completions = state.beam_outputs or []
        elif state.kind is RequestOutputKind.DELTA:
            completions = [c for s in sorted(state.samples.values(), key=lambda s: s.index)
                           if (c := self._delta(state, s)) is not None]
        else:
            completions = [
                CompletionOutput(
                    index=s.index,
                    text=s.text,
                    token_ids=list(s.token_ids),
                    cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                    logprobs=s.logprobs,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
                for s in sorted(state.samples.values(), key=lambda s: s.index)
            ]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=completions,
            finished=state.finished,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
            lora_request=state.lora_request,
        )

    @staticmethod
    def _delta(state: RequestOutputState, s: SampleState) -> CompletionOutput | None:
        """What is new in sample `s` since its previous delta; None if nothing is."""
        text = s.text
        visible = len(text)
        if s.finish_reason is None and state.held_stop:
            visible -= num_held_back_chars(text, state.held_stop)
        new_text = text[s.sent_chars:visible] if visible > s.sent_chars else ""
        s.sent_chars = max(s.sent_chars, visible)
        end = len(s.token_ids)
        new_ids = s.token_ids[s.sent_tokens:end]
        new_lps = s.logprobs[s.sent_tokens:end] if s.logprobs is not None else None
        s.sent_tokens = end
        newly_finished = s.finish_reason is not None and not s.finish_sent
        if not new_ids and not new_text and not newly_finished:
            return None
        s.finish_sent = s.finish_reason is not None
        return CompletionOutput(
            index=s.index, text=new_text, token_ids=new_ids,
            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
            logprobs=new_lps, finish_reason=s.finish_reason, stop_reason=s.stop_reason,
        )

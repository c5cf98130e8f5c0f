"""After the runner sampled: append each token and decide whether the sequence stops (EOS,
stop token, grammar, max_tokens, max_model_len); stop strings are checked by the front end on
the text. Also turns prompt logits into prompt logprobs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.layers.sampling_logprobs import SamplerOutput, compute_prompt_logprobs
from pagedllm.engine.core_messages import PromptLogprobEntry, TokenLogprob

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pagedllm.core.scheduler_output import ScheduledSequence
    from pagedllm.engine.request_state import RequestState
    from pagedllm.layers.sampler import Sampler


class SequenceUpdater:
    def __init__(self, eos_token_ids: set[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    # ---- appending a token ----------------------------------------------------------------

    def append_token(
        self, state: "RequestState", seq: SequenceState, out: SamplerOutput, row: int
    ) -> tuple[int, TokenLogprob | None, SequenceStatus | None, int | None]:
        """Append row `row`'s token to `seq`: (token, its logprob entry or None, the finished
        status if it stops now, the stop token id that stopped it). Stop strings are the front
        end's (it sees the text)."""
        params = state.params
        token = out.sampled_token_ids[row]
        seq.append_token(token)
        logprob: TokenLogprob | None = None
        if params.logprobs is not None:
            logprob = (token, out.sampled_logprobs[row], out.sampled_ranks[row],
                       list(out.top_logprobs[row] or ()))
        n_out = seq.num_output_tokens
        status: SequenceStatus | None = None
        stop_reason: int | None = None
        if n_out >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                status = SequenceStatus.FINISHED_STOPPED
            elif token in params.stop_token_ids:
                status = SequenceStatus.FINISHED_STOPPED
                stop_reason = token
        grammar = seq.grammar
        if grammar is not None:
            # The grammar advances with every token; once it has accepted its stop token (or
            # rejects one, which the mask should make impossible) the sequence is done.
            if not grammar.accept_token(token):
                logger.warning("request %s: token %d is not accepted by its grammar; stopping",
                               state.request_id, token)
                status = SequenceStatus.FINISHED_STOPPED
            elif grammar.is_terminated():
                status = SequenceStatus.FINISHED_STOPPED
        if status is None and (n_out >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            seq.grammar = None  # its state is not needed any more
        return token, logprob, status, stop_reason

    # ---- prompt logprobs ------------------------------------------------------------------

    def add_prompt_logprobs(
        self, state: "RequestState", item: "ScheduledSequence", logits: torch.Tensor,
        sampler: "Sampler",
    ) -> list[PromptLogprobEntry]:
        """Logprobs of prompt tokens 1.. from this chunk's rows (row i predicts token i+1):
        the entries not reported yet (the first call starts with None for token 0)."""
        prompt = state.prompt_token_ids
        start, n = item.start_pos, len(item.token_ids)
        new: list[PromptLogprobEntry] = []
        if state.num_prompt_logprobs == 0:
            new.append(None)  # nothing predicts the first prompt token
            state.num_prompt_logprobs = 1
        # Row i predicts the token at start + i + 1. Skip positions already reported (a chunk
        # recomputed after preemption) and the last row (it predicts the first output token).
        first = max(start, state.num_prompt_logprobs - 1)
        end = min(start + n, len(prompt) - 1)
        if end > first:
            entries = compute_prompt_logprobs(
                logits[first - start : end - start], prompt[first + 1 : end + 1],
                state.params.prompt_logprobs,
            )
            for entry in entries:
                new.append({tid: (lp.logprob, lp.rank) for tid, lp in entry.items()})
            state.num_prompt_logprobs += len(entries)
        if start + n >= len(prompt):
            state.prompt_logprobs_done = True
        return new

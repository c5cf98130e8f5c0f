"""After the sampler: append each sampled token and decide whether the sequence stops (EOS,
stop token, max_tokens, max_model_len); stop strings are checked by the front end on the text.

Also builds the per-row sampling inputs and turns prompt logits into prompt logprobs, so that
the engine's step stays a short list of calls.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pagedllm.core.request import Sequence, SequenceStatus
from pagedllm.layers.sampler import PenaltyCounts, SamplerOutput, SamplingMetadata, SamplingRow
from pagedllm.engine.core_messages import PromptLogprobEntry, TokenLogprob

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pagedllm.core.scheduler import ScheduledSequence
    from pagedllm.engine.request_state import RequestState, SeqState
    from pagedllm.layers.sampler import Sampler


class SequenceUpdater:
    def __init__(self, eos_token_ids: set[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    # ---- sampling inputs ------------------------------------------------------------------

    def build_sampling_metadata(
        self, rows: list[tuple["RequestState", Sequence]], device: torch.device,
        masks: dict[int, torch.Tensor] | None = None, mask_keys: list[int] | None = None,
    ) -> SamplingMetadata:
        """`masks` (key -> packed bitmask row, from StructuredOutputManager) and `mask_keys`
        (each row's key) give the constrained rows their token bitmask."""
        sampling_rows = []
        blocked_eos = min(self.eos_token_ids) if self.eos_token_ids else None
        for state, seq in rows:
            st = seq.data["state"]
            p = state.params
            if st.penalty_counts is None and (p.presence_penalty or p.frequency_penalty
                                              or p.repetition_penalty != 1.0):
                st.penalty_counts = PenaltyCounts()
            sampling_rows.append(
                SamplingRow(
                    params=p,
                    prompt_token_ids=seq.prompt_token_ids,
                    output_token_ids=seq.output_token_ids,
                    generator=st.generator,
                    penalty_counts=st.penalty_counts,
                )
            )
            # min_tokens must block every EOS id of the model, not only the first.
            state.params.all_stop_token_ids.update(self.eos_token_ids)
        md = SamplingMetadata.build(sampling_rows, eos_token_id=blocked_eos, device=device)
        if masks:
            keyed = [(r, masks[k]) for r, k in enumerate(mask_keys or ()) if k in masks]
            if keyed:
                md.bitmask_rows = [r for r, _ in keyed]
                md.token_bitmask = torch.stack([m for _, m in keyed])
        return md

    # ---- appending a token ----------------------------------------------------------------

    def append_token(
        self, state: "RequestState", seq: Sequence, out: SamplerOutput, row: int
    ) -> tuple[int, TokenLogprob | None, SequenceStatus | None]:
        """Append row `row`'s token to `seq`: (token, its logprob entry or None, the finished
        status if it stops now). Stop strings are the front end's (it sees the text)."""
        params = state.params
        st: SeqState = seq.data["state"]
        token = out.sampled_token_ids[row]
        seq.append_token(token)
        logprob: TokenLogprob | None = None
        if st.wants_logprobs:
            logprob = (token, out.sampled_logprobs[row], out.sampled_ranks[row],
                       list(out.top_logprobs[row] or ()))
        n_out = seq.num_output_tokens
        status: SequenceStatus | None = None
        if n_out >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                status = SequenceStatus.FINISHED_STOPPED
            elif token in params.stop_token_ids:
                status = SequenceStatus.FINISHED_STOPPED
                st.stop_reason = token
        if st.matcher is not None:
            # The grammar advances with every token; once it has accepted its stop token (or
            # rejects one, which the mask should make impossible) the sequence is done.
            if not st.matcher.accept_token(token):
                logger.warning("request %s: token %d is not accepted by its grammar; stopping",
                               state.request_id, token)
                status = SequenceStatus.FINISHED_STOPPED
            elif st.matcher.is_terminated():
                status = SequenceStatus.FINISHED_STOPPED
        if status is None and (n_out >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            st.finish_reason = status.finish_reason
            st.matcher = None  # its state is not needed any more
        return token, logprob, status

    # ---- prompt logprobs ------------------------------------------------------------------

    def add_prompt_logprobs(
        self, state: "RequestState", item: "ScheduledSequence", logits: torch.Tensor,
        sampler: "Sampler",
    ) -> list[PromptLogprobEntry]:
        """Logprobs of prompt tokens 1.. from this chunk's rows (row i predicts token i+1):
        the entries not reported yet (the first call starts with None for token 0)."""
        from pagedllm.layers.sampler import compute_prompt_logprobs

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

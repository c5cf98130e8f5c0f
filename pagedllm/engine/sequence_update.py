"""After the sampler: append each sampled token, detokenize it, and decide whether the
sequence stops (EOS, stop token, stop string, max_tokens, max_model_len).

Also builds the per-row sampling inputs and turns prompt logits into prompt logprobs, so that
the engine's step stays a short list of calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.core.request import Sequence, SequenceStatus
from pagedllm.layers.sampler import SamplerOutput, SamplingMetadata, SamplingRow
from pagedllm.outputs import make_logprob_dict
from pagedllm.tokenizer import check_stop_strings

if TYPE_CHECKING:
    from pagedllm.core.scheduler import ScheduledSequence
    from pagedllm.engine.request_state import RequestState, SeqState
    from pagedllm.layers.sampler import Sampler


class SequenceUpdater:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._decoded: dict[int, str] = {}

    def decode_token(self, token_id: int) -> str:
        text = self._decoded.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._decoded[token_id] = text
        return text

    # ---- sampling inputs ------------------------------------------------------------------

    def build_sampling_metadata(
        self, rows: list[tuple["RequestState", Sequence]], device: torch.device
    ) -> SamplingMetadata:
        sampling_rows = []
        blocked_eos = min(self.eos_token_ids) if self.eos_token_ids else None
        for state, seq in rows:
            sampling_rows.append(
                SamplingRow(
                    params=state.params,
                    prompt_token_ids=seq.prompt_token_ids,
                    output_token_ids=seq.output_token_ids,
                    generator=seq.data["state"].generator,
                )
            )
            # min_tokens must block every EOS id of the model, not only the first.
            state.params.all_stop_token_ids.update(self.eos_token_ids)
        return SamplingMetadata.build(sampling_rows, eos_token_id=blocked_eos, device=device)

    # ---- appending a token ----------------------------------------------------------------

    def append_token(
        self, state: "RequestState", seq: Sequence, out: SamplerOutput, row: int
    ) -> SequenceStatus | None:
        """Append row `row`'s token to `seq`; return the finished status if it stops now."""
        params = state.params
        st: SeqState = seq.data["state"]
        token = out.sampled_token_ids[row]
        seq.append_token(token)
        if st.logprobs is not None:
            lp = out.sampled_logprobs[row]
            st.cumulative_logprob += lp
            st.logprobs.append(
                make_logprob_dict(token, lp, out.sampled_ranks[row], out.top_logprobs[row] or (),
                                  self.decode_token)
            )
        n_out = seq.num_output_tokens
        status: SequenceStatus | None = None
        stop_token = False
        if n_out >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                status, stop_token = SequenceStatus.FINISHED_STOPPED, True
            elif token in params.stop_token_ids:
                status, stop_token = SequenceStatus.FINISHED_STOPPED, True
                st.stop_reason = token
        # A stop token's own text is not part of the output (unless asked for).
        if not stop_token or params.include_stop_str_in_output:
            delta = st.detokenizer.add_token(token)
            st.text = st.detokenizer.text
            if status is None and params.stop and n_out >= params.min_tokens:
                hit = check_stop_strings(st.text, len(delta), params.stop,
                                         params.include_stop_str_in_output)
                if hit is not None:
                    stop_str, truncate_to = hit
                    st.text = st.text[:truncate_to]
                    st.stop_reason = stop_str
                    status = SequenceStatus.FINISHED_STOPPED
        if status is None and (n_out >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            st.finish_reason = status.finish_reason
        return status

    # ---- prompt logprobs ------------------------------------------------------------------

    def add_prompt_logprobs(
        self, state: "RequestState", item: "ScheduledSequence", logits: torch.Tensor,
        sampler: "Sampler",
    ) -> None:
        """Logprobs of prompt tokens 1.. from this chunk's rows (row i predicts token i+1)."""
        from pagedllm.layers.sampler import compute_prompt_logprobs

        prompt = state.prompt_token_ids
        start, n = item.start_pos, len(item.token_ids)
        # Row i predicts the token at start + i + 1. Skip positions already recorded (a chunk
        # recomputed after preemption) and the last row (it predicts the first output token).
        first = max(start, len(state.prompt_logprobs) - 1)
        end = min(start + n, len(prompt) - 1)
        if end > first:
            entries = compute_prompt_logprobs(
                logits[first - start : end - start], prompt[first + 1 : end + 1],
                state.params.prompt_logprobs,
            )
            for entry in entries:
                for tid, lp in entry.items():
                    lp.decoded_token = self.decode_token(tid)
                state.prompt_logprobs.append(entry)
        if start + n >= len(prompt):
            state.prompt_logprobs_done = True

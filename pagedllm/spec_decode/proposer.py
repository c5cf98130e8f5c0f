"""Draft tokens for the running decodes of the next step, in the engine core (rank 0)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from pagedllm.core.request import SequenceState
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram import propose_ngram

class Proposer:
    """What the engine core calls on a proposer, once per step (every hook but `propose` is a
    no-op here): `propose` before the schedule (sets `Sequence.spec_token_ids`), `draft_inputs`
    for the step plan (core/step_plan.py) after the schedule, `after_step` with the runner's accepted
    counts, `on_finished` when a sequence ends (a proposer that learns from finished outputs)."""

    config: SpeculativeConfig

    def propose(self, running: Iterable[tuple[SequenceState, Any]]) -> int:
        raise NotImplementedError

    def draft_inputs(self, scheduled: list[Any]) -> dict[int, tuple[int, list[int]]]:
        """seq id -> (draft_start, draft_input_ids) for a draft model to run this step."""
        return {}

    def deactivate(self) -> None:
        """This step proposes nothing (`disable_by_batch_size`)."""
        return None

    def after_step(self, scheduled: list[Any], plan: Any, num_accepted: dict[int, int]) -> None:
        return None

    def on_finished(self, seq: SequenceState) -> None:
        return None

    def max_draft_len(self, seq: SequenceState, params: Any) -> int:
        """The most draft tokens `seq` may get: `num_speculative_tokens`, never past max_tokens
        (one token is always sampled after the drafts) or max_model_len."""
        return min(self.config.num_speculative_tokens, params.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens)


class SpecDecodeStats:
    """Cumulative counts under vLLM's metric names (vllm:spec_decode_num_drafts, ...): drafts
    (steps of a sequence with a proposal), their tokens, the accepted ones, and accepted per
    position (position j: the j-th draft token of a proposal)."""

    def __init__(self, k: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class NgramProposer(Proposer):
    """vLLM's "ngram" method over each sequence's own prompt and output."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        if config.method != "ngram":
            raise ValueError(f"NgramProposer is for method 'ngram', not {config.method!r}.")
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len

    def propose(self, running: Iterable[tuple[SequenceState, Any]]) -> int:
        """Set `spec_token_ids` of each (sequence, its sampling params) about to decode; the
        number of sequences given a proposal. A proposal never runs past max_tokens (one token
        is always sampled after the drafts) or max_model_len."""
        cfg = self.config
        n = 0
        for seq, params in running:
            k = self.max_draft_len(seq, params)
            if k <= 0:
                continue
            tokens = np.fromiter(seq.all_token_ids, dtype=np.int64, count=seq.num_tokens)
            draft = propose_ngram(tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max, k)
            if draft.size:
                seq.spec_token_ids = draft.tolist()
                n += 1
        return n

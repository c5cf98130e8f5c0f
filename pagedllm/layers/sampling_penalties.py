"""Repetition, frequency and presence penalties (step 3 of layers/sampler.py's order), with each
sequence's token statistics kept across steps (`PenaltyCounts`) so that a step counts only its
new tokens. Its own module because it is the one sampler step with state per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.layers.sampler import SamplingMetadata


class PenaltyCounts:
    """One sequence's token statistics for the penalties, kept across steps: each step adds
    only the output tokens that are new since the previous one (one `index_add_`, usually of a
    single token), and the prompt's token set is computed once. Rebuilding both from the token
    lists every step cost O(length) a row a step. Ids outside the vocabulary are ignored."""

    def __init__(self) -> None:
        self.output_counts: torch.Tensor | None = None  # [V] float32
        self.prompt_mask: torch.Tensor | None = None  # [V] bool
        self.counted = 0  # output tokens already in output_counts

    def update(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
               vocab_size: int, device: torch.device, need_prompt: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        counts = self.output_counts
        if (counts is None or counts.shape[0] != vocab_size or counts.device != device
                or len(output_token_ids) < self.counted):
            counts = self.output_counts = torch.zeros(vocab_size, dtype=torch.float32,
                                                      device=device)
            self.counted = 0
            self.prompt_mask = None
        if len(output_token_ids) > self.counted:
            new = _in_vocab(output_token_ids[self.counted:], vocab_size, device)
            counts.index_add_(0, new, torch.ones(new.shape[0], dtype=torch.float32,
                                                 device=device))
            self.counted = len(output_token_ids)
        if need_prompt and self.prompt_mask is None:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            mask[_in_vocab(prompt_token_ids, vocab_size, device)] = True
            self.prompt_mask = mask
        return counts, self.prompt_mask


def _in_vocab(ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(list(ids), dtype=torch.int64)
    return t[(t >= 0) & (t < vocab_size)].to(device)


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """vLLM's apply_penalties, on the rows whose penalties are not neutral."""
    active = (
        (md.presence_penalties != 0.0)
        | (md.frequency_penalties != 0.0)
        | (md.repetition_penalties != 1.0)
    )
    idx = torch.nonzero(active).squeeze(1)
    idx_list = idx.tolist()
    if not idx_list:
        return
    vocab_size = logits.shape[1]
    sub = logits.index_select(0, idx)
    rep = md.repetition_penalties.index_select(0, idx)
    need_prompt = bool((rep != 1.0).any())
    states = md.penalty_counts or [None] * len(md.output_token_ids)
    counts, prompts = [], []
    for i in idx_list:
        state = states[i] if states[i] is not None else PenaltyCounts()  # kept or one-off
        c, m = state.update(md.prompt_token_ids[i], md.output_token_ids[i], vocab_size,
                            sub.device, need_prompt)
        counts.append(c)
        prompts.append(m)
    out_counts = torch.stack(counts)
    out_mask = out_counts > 0
    if need_prompt:
        prompt_mask = torch.stack(prompts)
        factor = torch.where(prompt_mask | out_mask, rep.unsqueeze(1), 1.0)
        sub = torch.where(sub > 0, sub / factor, sub * factor)
    sub -= md.frequency_penalties.index_select(0, idx).unsqueeze(1) * out_counts
    sub -= md.presence_penalties.index_select(0, idx).unsqueeze(1) * out_mask
    logits[idx] = sub

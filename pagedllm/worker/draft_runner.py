"""The draft model in the runner (speculative decoding's draft-model method): it runs before
the target in the same step and fills the step's placeholder drafts with its greedy tokens.

The draft has a ModelRunner of its own (its model, its KV tensors) that reads the *target's*
block tables: the same block ids hold both models' K/V of the same positions (the engine core
side: spec_decode/draft_model.py). The target runner applies the step's table changes first;
the draft then builds its inputs through the same `prepare_input` with no table change.

One step: a first pass over every sequence's `draft_input_ids` (what the draft lacks up to its
last token, or a prefill chunk it follows) whose last rows give each proposal's first draft;
then one-token passes for the rest, each draft fed back at the next position (the slots the
scheduler allocated for the drafts).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.core.step_plan import SequenceStep
from pagedllm.worker.block_table import BlockTable


def _draft_step(seq_id: int, token_ids: list[int], start_pos: int, table: BlockTable, sample: bool) -> SequenceStep:
    """A pass of the draft over `token_ids`: the table as it is (no change: the target's applied it)."""
    return SequenceStep(seq_id, token_ids, start_pos, table.num_blocks_of(seq_id), [], sample)


class DraftModelRunner:
    def __init__(self, runner: Any, block_tables: list[BlockTable]) -> None:
        """`runner`: the draft model's ModelRunner (same num_blocks and block_size as the
        target's); it is made to read `block_tables`, the target runner's."""
        if len(block_tables) != 1:
            raise ValueError("a draft model needs one block table (no hybrid KV cache)")
        self.runner = runner
        runner.block_tables = block_tables
        runner.block_table = block_tables[0]

    @property
    def cache_engine(self):
        return self.runner.cache_engine

    @torch.no_grad()
    def propose(self, scheduled: list[SequenceStep]) -> dict[int, list[int]]:
        """seq id -> its drafts (as many as its placeholders), for the sequences that have
        placeholders; every sequence with `draft_input_ids` has them run."""
        table = self.runner.block_table
        first: list[SequenceStep] = []
        wanted: dict[int, int] = {}
        starts: dict[int, int] = {}
        for s in scheduled:
            ids = s.draft_input_ids
            seq_id = s.seq_id
            n_drafts = len(s.draft_token_ids)
            if not ids:
                if n_drafts:
                    raise ValueError(f"sequence {seq_id}: {n_drafts} draft placeholders but no draft inputs")
                continue
            if n_drafts:
                wanted[seq_id] = n_drafts
                starts[seq_id] = s.draft_start + len(ids)  # the first draft's position
            first.append(_draft_step(seq_id, list(ids), s.draft_start, table, bool(n_drafts)))
        if not first:
            return {}
        tokens = self._greedy(first)
        drafts = {seq_id: [t] for seq_id, t in zip(wanted, tokens)}
        for p in range(1, max(wanted.values(), default=0)):
            batch = [_draft_step(seq_id, [drafts[seq_id][-1]], starts[seq_id] + p - 1, table, True)
                     for seq_id, n in wanted.items() if n > p]
            for step, t in zip(batch, self._greedy(batch)):
                drafts[step.seq_id].append(t)
        return drafts

    def _greedy(self, steps: list[SequenceStep]) -> list[int]:
        """One draft forward; the argmax of each sampled step's last row, in order."""
        inp = self.runner.prepare_input(steps)
        logits = self.runner.run_model(inp)
        if logits is None or logits.shape[0] == 0:
            return []
        return logits.argmax(dim=-1).tolist()

"""A step's sampling, after the forward, on the runner's persistent batch (worker/input_batch.py):
the rows of the sampled sequences (a sequence's n > 1 forks at its first sample; a speculating
sequence one row per verified position), the grammar masks the core filled during the forward,
and the verification of draft tokens (spec_decode/verify.py)."""

from __future__ import annotations

import torch

from pagedllm.core.step_plan import StepPlan
from pagedllm.layers.sampler import Sampler, SamplerOutput
from pagedllm.spec_decode.verify import rows_to_keep
from pagedllm.worker.input_batch import InputBatch, sample_batch


def sample_step(sampler: Sampler, batch: InputBatch, plan: StepPlan, sample_logits: torch.Tensor,
                num_accepted: dict[int, int], draft_tokens: dict[int, list[int]] | None = None) -> SamplerOutput | None:
    """One token for every sampled sequence with a row (and its forks at the first sample),
    after the structured-output masks the core filled during the forward. A sequence with
    draft tokens draws one at each verified position (spec_decode/verify.py); its accepted
    drafts and the next token are kept, their counts go to `num_accepted`."""
    rows: list[int] = []
    logits_rows: list[int] = []
    mask_keys: list[int] = []
    extras: list[list[int]] = []
    spans: list[tuple[int, list[int]]] = []  # per sampled row group: first row, drafts
    spec_seqs: list[int] = []
    j = 0
    for s in plan.sequences:
        if not s.sample:
            continue
        seq_id = s.seq_id
        drafts = (draft_tokens or {}).get(seq_id) or s.draft_token_ids
        if seq_id in batch:
            if drafts:
                row = batch.row_of[seq_id]
                spans.append((len(rows), drafts))
                spec_seqs.append(seq_id)
                for p in range(len(drafts) + 1):
                    rows.append(row)
                    logits_rows.append(j + p)
                    mask_keys.append((seq_id, p))  # the mask after its first p drafts
                    extras.append(drafts[:p])
            else:
                for row in batch.start_rows(seq_id):
                    spans.append((len(rows), []))
                    rows.append(row)
                    logits_rows.append(j)
                    mask_keys.append(seq_id)
                    extras.append([])
        j += 1 + len(drafts)
    if not rows:
        return None
    masks = plan.token_masks.result() if plan.token_masks is not None else None
    if not spec_seqs:
        return sample_batch(sampler, batch, sample_logits, rows, logits_rows, mask_keys, masks)
    out = sample_batch(sampler, batch, sample_logits, rows, logits_rows, mask_keys, masks,
                       extra_outputs=extras)
    keep, accepted = rows_to_keep(out.sampled_token_ids, spans)
    num_accepted.update(zip(spec_seqs, (n for (_, d), n in zip(spans, accepted) if d)))
    out = SamplerOutput(*([column[i] for i in keep] for column in (
        out.sampled_token_ids, out.sampled_logprobs, out.sampled_ranks, out.top_logprobs)))
    batch.record([rows[i] for i in keep], out.sampled_token_ids)
    return out

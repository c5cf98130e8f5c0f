"""The runner's side of image inputs: the encoder cache (content hash -> an image's embedding
rows, exactly the entries the scheduler's `EncoderCacheManager` lists: a plan's
`freed_encoder_hashes` go, its `encoder_inputs` are encoded) and the step's input embeddings,
the text embedding with each placeholder position's row replaced by its image row; for a model
that attends bidirectionally inside an image (Gemma 3), the image blocks of the step's prefill
chunks as spans of its attention metadata.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.core.step_plan import SequenceStep, StepPlan
from pagedllm.layers.attention import AttentionMetadata


class MultiModalEmbeddings:
    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.rows: dict[bytes, torch.Tensor] = {}

    @classmethod
    def of(cls, model: Any, device: torch.device) -> MultiModalEmbeddings | None:
        """The runner's image side for a multimodal model; None for a text-only one."""
        from pagedllm.model.multimodal import is_multimodal

        return cls(model, device) if is_multimodal(model) else None

    def attach(self, inp: Any, scheduled: list[SequenceStep]) -> None:
        """Set the step's `inputs_embeds` when it holds image rows; such a step runs eager
        (compiled graphs and the C decode step embed ids themselves), and for Gemma 3 its
        attention metadata's bidirectional image spans."""
        inp.inputs_embeds = self.inputs_embeds(inp.input_ids, inp.first_rows, scheduled)
        if inp.inputs_embeds is not None:
            inp.decode_only = False
            self.mark_bidirectional(inp.attn_metadata, inp.first_rows, scheduled)

    def apply(self, plan: StepPlan) -> None:
        """Drop the freed entries, then encode this step's images (one at a time: an image's
        rows do not depend on what else is batched)."""
        for h in plan.freed_encoder_hashes:
            self.rows.pop(h, None)
        for feature in plan.encoder_inputs:
            data = {name: t.to_torch() for name, t in feature.data.items()}
            rows = self.model.embed_multimodal(data)
            if rows.dim() != 2 or rows.shape[0] != feature.num_rows:
                raise ValueError(f"the vision encoder gave {tuple(rows.shape)} rows for an image with "
                                 f"{feature.num_rows} placeholder positions")
            self.rows[feature.content_hash] = rows

    def inputs_embeds(self, input_ids: torch.Tensor, first_rows: list[int],
                      scheduled: list[SequenceStep]) -> torch.Tensor | None:
        """The step's input embeddings when a chunk holds image positions (None otherwise: the
        model embeds the ids itself, the text-only path unchanged)."""
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for first, s in zip(first_rows, scheduled):
            for h, pos, length, row in (s.images.runs if s.images is not None else ()):
                rows = self.rows.get(h)
                if rows is None:
                    raise ValueError(f"sequence {s.seq_id}: the rows of image {h.hex()[:12]} are not in the encoder "
                                     "cache (the scheduler and the runner disagree)")
                at = first + pos - s.start_pos
                targets.append(torch.arange(at, at + length, device=self.device))
                sources.append(rows[row:row + length])
        if not targets:
            return None
        index = torch.cat(targets)
        ids = input_ids.clone()
        ids[index] = 0  # a placeholder id may lie outside the text vocabulary: its row is replaced
        embeds = self.model.embed_input_ids(ids)
        embeds[index] = torch.cat(sources).to(embeds.dtype)
        return embeds

    def mark_bidirectional(self, attn_metadata: AttentionMetadata, first_rows: list[int],
                           scheduled: list[SequenceStep]) -> None:
        """Set `prefill_bidirectional_spans` (every KV cache group's metadata) when the model
        attends bidirectionally inside an image block: each prefill sequence's placeholder runs
        in this chunk. A run is one block (transformers' maximal run of image tokens: one
        image, or one pan-and-scan crop). Runs are clipped to the chunk; keys of a run before
        the chunk (a prefix-cache hit inside an image) are visible to its queries causally."""
        if not self.model.bidirectional_images:
            return
        by_row = dict(zip(first_rows, scheduled))
        spans = [[(pos, pos + length) for _, pos, length, _ in
                  (by_row[q].images.runs if by_row[q].images is not None else ())]
                 for q in attn_metadata.prefill_query_starts]
        if any(spans):
            for md in (attn_metadata, *attn_metadata.group_metadata):
                md.prefill_bidirectional_spans = spans

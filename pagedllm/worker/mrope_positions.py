"""The rotary positions of a step of an M-RoPE model (Qwen2-VL; layers/mrope.py), apart from
the 1-D positions that place its tokens in the KV cache.

Each `SequenceStep` says how its tokens' rotary positions differ from their 1-D ones
(multimodal/mrope.py): `mrope_delta` shifts every token (the images before it moved the text
positions: decode steps of a prompt with images), and `mrope_positions` gives the first k
tokens' 3-D positions where the chunk overlaps an image. The step's positions stay `[T]` unless
some chunk has 3-D ones, so decode steps keep their fast paths (C decode step, graphs).
"""

from __future__ import annotations

import torch

from pagedllm.core.step_plan import SequenceStep


def mrope_positions(positions: torch.Tensor, steps: list[SequenceStep], first_rows: list[int]) -> torch.Tensor:
    """`positions` [T] (host, the KV positions of the step's tokens; `steps[j]`'s start at row
    `first_rows[j]`) -> the rotary positions: [T], or [3, T] where some chunk has 3-D ones."""
    moved = [(first, s.images, len(s.token_ids), s.seq_id) for first, s in zip(first_rows, steps)
             if s.images is not None and (s.images.mrope_delta or s.images.mrope_positions)]
    if not moved:
        return positions
    out = positions.clone()
    for first, im, n, _ in moved:
        if im.mrope_delta:
            out[first:first + n] += im.mrope_delta
    if not any(im.mrope_positions for _, im, _, _ in moved):
        return out
    out = out.expand(3, -1).clone()
    for first, im, n, seq_id in moved:
        if im.mrope_positions:
            k = len(im.mrope_positions[0])
            if k > n or any(len(axis) != k for axis in im.mrope_positions):
                raise ValueError(f"sequence {seq_id}: M-RoPE positions for {k} tokens of a chunk of "
                                 f"{n} (3 equal axes, at most the chunk)")
            out[:, first:first + k] = torch.tensor(im.mrope_positions, dtype=out.dtype)
    return out

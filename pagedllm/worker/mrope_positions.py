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
    moved = [(first, s) for first, s in zip(first_rows, steps) if s.mrope_delta or s.mrope_positions]
    if not moved:
        return positions
    out = positions.clone()
    for first, s in moved:
        if s.mrope_delta:
            out[first:first + len(s.token_ids)] += s.mrope_delta
    if not any(s.mrope_positions for _, s in moved):
        return out
    out = out.expand(3, -1).clone()
    for first, s in moved:
        if s.mrope_positions:
            k = len(s.mrope_positions[0])
            if k > len(s.token_ids) or any(len(axis) != k for axis in s.mrope_positions):
                raise ValueError(f"sequence {s.seq_id}: M-RoPE positions for {k} tokens of a chunk of "
                                 f"{len(s.token_ids)} (3 equal axes, at most the chunk)")
            out[:, first:first + k] = torch.tensor(s.mrope_positions, dtype=out.dtype)
    return out

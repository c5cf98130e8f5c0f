"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL): computed once per prompt in the front end, carried
by the prompt's images, cut per chunk by the step planner.

A prompt token has three rotary positions (temporal, height, width). Text tokens have the same
value on all three: their index plus the offset `D` that the images before them add (an image
of `n` tokens advances the positions by `max(h, w)` merged patches, not `n`); an image's tokens
have their own grid positions. transformers' `get_rope_index` computes them
(`prompt_positions`, called with a stand-in for the model: it reads only the config); each
image's `MultiModalFeature` then carries its tokens' positions and the `D` of the text after it
(`with_positions`), which is all that is needed to rebuild any chunk's positions
(`chunk_positions`, pure Python: the core imports no torch) — after chunking, preemption or a
prefix-cache hit alike, since they come from the request, never from what was computed. Tokens
past the prompt are at `position + D` of the last image (transformers' `rope_deltas`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagedllm.multimodal.inputs import MultiModalFeature


def chunk_positions(features: tuple[MultiModalFeature, ...] | list[MultiModalFeature], start: int,
                    num_tokens: int, prompt_len: int) -> tuple[list[list[int]], int]:
    """(positions, delta) of tokens [start, start + num_tokens): `positions` [3][k] for the
    chunk's first k tokens where it overlaps an image (else []), `delta` for every other token
    (its rotary position on all three axes is its 1-D position + delta)."""
    mine = [f for f in features if f.mrope_positions is not None]
    if not mine:
        return [], 0
    end = min(start + num_tokens, prompt_len)
    if not any(f.overlaps(start, end) for f in mine):
        before = [f.mrope_delta for f in mine if f.end <= start]
        return [], before[-1] if before else 0
    t: list[int] = []
    h: list[int] = []
    w: list[int] = []
    at, delta = start, 0
    for f in mine:
        if f.end <= start:
            delta = f.mrope_delta
            continue
        if f.start >= end:
            break
        text = range(at + delta, min(f.start, end) + delta)  # the text before this image
        t.extend(text), h.extend(text), w.extend(text)
        a, b = max(f.start, start) - f.start, min(f.end, end) - f.start
        ft, fh, fw = f.mrope_positions
        t.extend(ft[a:b]), h.extend(fh[a:b]), w.extend(fw[a:b])
        at, delta = min(f.end, end), f.mrope_delta
    text = range(at + delta, end + delta)
    t.extend(text), h.extend(text), w.extend(text)
    return [t, h, w], mine[-1].mrope_delta


def _rope_index_owner(architecture: str, mm_config: Any) -> Any:
    """A stand-in for transformers' VL model with what its `get_rope_index` reads: the config
    and `get_vision_position_ids` (neither touches weights)."""
    if architecture == "Qwen2VLForConditionalGeneration":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel as model_cls
    elif architecture == "Qwen2_5_VLForConditionalGeneration":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as model_cls
    else:
        raise ValueError(f"{architecture} has no M-RoPE positions")
    owner = type("RopeIndex", (), {"get_rope_index": model_cls.get_rope_index,
                                   "get_vision_position_ids": model_cls.get_vision_position_ids})()
    owner.config = mm_config
    return owner


def prompt_positions(architecture: str, mm_config: Any, out: Any) -> tuple[list[list[int]], int]:
    """(positions [3][prompt_len], rope delta) of one processed prompt (`out`: the processor's
    input_ids, mm_token_type_ids and image_grid_thw), by transformers' `get_rope_index`."""
    if out.get("mm_token_type_ids") is None:
        raise ValueError("the processor gave no mm_token_type_ids: M-RoPE positions cannot be computed")
    positions, deltas = _rope_index_owner(architecture, mm_config).get_rope_index(
        out["input_ids"], mm_token_type_ids=out["mm_token_type_ids"], image_grid_thw=out.get("image_grid_thw"))
    return positions[:, 0].tolist(), int(deltas.reshape(-1)[0])


def with_positions(features: list[MultiModalFeature], positions: list[list[int]],
                   delta: int) -> list[MultiModalFeature]:
    """The features carrying their tokens' positions and the offset after each; ValueError
    where they do not rebuild `positions` exactly (an image in several runs, a layout this
    representation cannot hold)."""
    length = len(positions[0])
    out = []
    for i, f in enumerate(features):
        if len(f.runs) != 1:
            raise ValueError(f"image {i} fills {len(f.runs)} placeholder runs; M-RoPE needs one run per image")
        after = positions[0][f.end] - f.end if f.end < length else delta
        out.append(msgspec.structs.replace(
            f, mrope_positions=[axis[f.start:f.end] for axis in positions], mrope_delta=after))
    rebuilt, final = chunk_positions(out, 0, length, length)
    if rebuilt != positions or (out and final != delta):
        raise ValueError("the prompt's M-RoPE positions are not text runs around whole images (not supported)")
    return out

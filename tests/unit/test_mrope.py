"""M-RoPE (Qwen2-VL): the rotary against transformers', the prompt's positions from transformers'
`get_rope_index` carried by the image features and rebuilt per chunk, and the runner's positions."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.step_plan import SequenceStep
from pagedllm.layers.mrope import MRotaryEmbedding
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.multimodal.inputs import MultiModalFeature, PlaceholderRun
from pagedllm.multimodal.mrope import chunk_positions, prompt_positions, with_positions
from pagedllm.worker.mrope_positions import mrope_positions

IMAGE = 7  # the image token of the synthetic prompts


def _text_config(arch: str):
    import transformers as tf

    text = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    cls = tf.Qwen2VLConfig if arch == "Qwen2VLForConditionalGeneration" else tf.Qwen2_5_VLConfig
    return cls(text_config=text, vision_config=dict(spatial_merge_size=2), image_token_id=IMAGE)


@pytest.mark.parametrize("arch", ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"])
def test_rotary_matches_transformers(arch):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    config = _text_config(arch).get_text_config()
    ours = MRotaryEmbedding.from_config(config)
    theirs = Qwen2VLRotaryEmbedding(config)
    positions = torch.randint(0, 500, (3, 37))
    cos, sin = ours(positions)
    want_cos, want_sin = theirs(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    # 1-D positions (all axes equal) are plain RoPE: what decode steps and the C step pass
    plain = RotaryEmbedding.from_config(config)
    flat = torch.arange(50)
    assert all(torch.equal(a, b) for a, b in zip(ours(flat), plain(flat)))
    assert all(torch.equal(a, b) for a, b in zip(ours(flat.expand(3, -1)), plain(flat)))


def _prompt(layout: list[int | tuple[int, int]]) -> tuple[list[int], torch.Tensor]:
    """Token ids of text runs (int: that many tokens) and images ((h, w) merged patches)."""
    ids, grids = [], []
    for part in layout:
        if isinstance(part, int):
            ids += [100 + i for i in range(part)]
        else:
            ids += [IMAGE] * (part[0] * part[1])
            grids.append([1, 2 * part[0], 2 * part[1]])
    return ids, torch.tensor(grids)


def _features(arch: str, layout) -> tuple[list[MultiModalFeature], list[list[int]], int, int]:
    ids, grid = _prompt(layout)
    t = torch.tensor([ids])
    out = {"input_ids": t, "mm_token_type_ids": (t == IMAGE).long(), "image_grid_thw": grid}
    positions, delta = prompt_positions(arch, _text_config(arch), out)
    runs, start = [], None
    for i, tok in enumerate(ids + [0]):
        if tok == IMAGE and start is None:
            start = i
        elif tok != IMAGE and start is not None:
            runs.append((start, i - start))
            start = None
    feats = [MultiModalFeature("image", bytes([k]), [PlaceholderRun(o, n, 0)], {}) for k, (o, n) in enumerate(runs)]
    return with_positions(feats, positions, delta), positions, delta, len(ids)


@pytest.mark.parametrize("arch", ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"])
@pytest.mark.parametrize("layout", [[3, (2, 3), 4, (4, 1), 2], [(3, 2), 5], [2, (1, 1), 1, (2, 2), 3], [4, (2, 5)]])
def test_chunks_rebuild_the_prompt_positions(arch, layout):
    feats, positions, delta, length = _features(arch, layout)
    assert delta != 0 and feats[-1].mrope_delta == delta
    total = length + 6  # six tokens past the prompt: position + delta on every axis
    want = [axis + list(range(length + delta, total + delta)) for axis in positions]
    for size in (1, 2, 3, 5, 8, total):
        got: list[list[int]] = [[], [], []]
        for start in range(0, total, size):
            n = min(size, total - start)
            explicit, d = chunk_positions(feats, start, n, length)
            k = len(explicit[0]) if explicit else 0
            assert k <= n and (not explicit or any(f.overlaps(start, start + n) for f in feats))
            for a in range(3):
                got[a] += (explicit[a] if explicit else []) + list(range(start + k + d, start + n + d))
        assert got == want, (size, got, want)


def test_image_in_several_runs_is_refused():
    feat = MultiModalFeature("image", b"x", [PlaceholderRun(1, 2, 0), PlaceholderRun(4, 2, 2)], {})
    with pytest.raises(ValueError, match="one run per image"):
        with_positions([feat], [list(range(8))] * 3, 0)


def test_runner_positions():
    steps = [SequenceStep(1, [5], 40, 0, [], True, mrope_delta=-9),  # a decode step
             SequenceStep(2, [5, 5, 5], 0, 0, [], True),  # text only: unchanged
             SequenceStep(3, [5, 5, 5, 5], 10, 0, [], True, mrope_positions=[[3, 3], [3, 4], [5, 5]], mrope_delta=-2)]
    positions = torch.tensor([40, 0, 1, 2, 10, 11, 12, 13])
    flat = mrope_positions(positions[:4], steps[:2], [0, 1])
    assert flat.tolist() == [31, 0, 1, 2] and positions[0] == 40  # 1-D; the KV positions untouched
    out = mrope_positions(positions, steps, [0, 1, 4])
    assert out.tolist() == [[31, 0, 1, 2, 3, 3, 10, 11], [31, 0, 1, 2, 3, 4, 10, 11], [31, 0, 1, 2, 5, 5, 10, 11]]
    assert mrope_positions(positions, steps[1:2], [1]) is positions  # nothing moved: no copy

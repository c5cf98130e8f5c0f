"""Idefics3 / SmolVLM: which `<image>` runs (crops) belong to which image, read off the expanded
ids (an image's runs end with the run after `<global-img>`), and the errors of a malformed prompt."""

from __future__ import annotations

import pytest

from pagedllm.multimodal.image_specs import image_spec_for
from pagedllm.multimodal.image_spec_idefics3 import Idefics3Spec, crops_per_image

IMG, FAKE, GLOBAL, ROW = 9, 7, 8, 6  # <image>, <fake_token_around_image>, <global-img>, a <row_i_col_j>


def _image(crops: int, seq: int = 2) -> list[int]:
    tiles = [t for _ in range(crops - 1) for t in (FAKE, ROW, *[IMG] * seq)]
    return tiles + [FAKE, GLOBAL, *[IMG] * seq, FAKE]


def test_crops_counted_per_image():
    ids = [1, *_image(5), 2, 3, *_image(1), *_image(3), 4]
    assert crops_per_image(ids, IMG, GLOBAL) == [5, 1, 3]
    assert crops_per_image([1, 2, 3], IMG, GLOBAL) == []


def test_runs_after_the_last_global_image_are_refused():
    with pytest.raises(ValueError, match="after the last <global-img> run belong to no image"):
        crops_per_image([*_image(2), FAKE, ROW, IMG, IMG], IMG, GLOBAL)


def test_both_architectures_use_the_spec():
    for arch in ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"):
        assert isinstance(image_spec_for(arch), Idefics3Spec)


def test_split_refuses_a_crop_count_that_does_not_match():
    import torch

    out = {"input_ids": torch.tensor([_image(2)]), "pixel_values": torch.zeros(1, 1, 3, 4, 4),
           "_crops_per_image": [2]}
    with pytest.raises(ValueError, match="does not hold the prompt's 2 crops"):
        Idefics3Spec().split_items(out, 1, None)
    with pytest.raises(ValueError, match="1 images' crop runs for 2 image"):
        Idefics3Spec().split_items({"_crops_per_image": [2]}, 2, None)

"""The core's check of a request's images (multimodal/checks.py) and the front end's refusal of
images for a text-only model: a request from another process is not trusted, and its content
hash keys rows other requests share."""

from __future__ import annotations

import hashlib

import pytest

from pagedllm.core.encoder_cache import EncoderCacheManager
from pagedllm.engine.input_processing import InputProcessor
from pagedllm.multimodal.checks import check_mm_features
from pagedllm.multimodal.inputs import MultiModalFeature, PlaceholderRun, TensorData, content_hash


def feature(runs, data=None, whole=False, forged=False) -> MultiModalFeature:
    data = data or {"pixel_values": TensorData("float32", [1], b"\x00\x00\x80?")}
    h = hashlib.sha256(b"someone else's image").digest() if forged else content_hash("image", data)
    return MultiModalFeature("image", h, [PlaceholderRun(o, n, r) for o, n, r in runs], data, whole)


def check(features, prompt_len=40, takes_images=True, cache=None, budget=64):
    check_mm_features(features, prompt_len, takes_images, cache or EncoderCacheManager(64, 64), budget, "m")


def test_a_well_formed_image_passes():
    check([feature([(2, 8, 0), (12, 4, 8)])])


def test_a_forged_content_hash_is_refused():
    with pytest.raises(ValueError, match="content hash does not match its data"):
        check([feature([(2, 8, 0)], forged=True)])


@pytest.mark.parametrize("runs", [[(35, 8, 0)], [(4, 4, 0), (2, 1, 4)], [(3, 0, 0)]])
def test_runs_outside_the_prompt_out_of_order_or_empty_are_refused(runs):
    with pytest.raises(ValueError, match="out of order or outside the prompt"):
        check([feature(runs)])


def test_an_image_the_encoder_cache_could_never_hold_is_refused():
    with pytest.raises(ValueError, match="more than the encoder cache"):
        check([feature([(0, 30, 0)])], cache=EncoderCacheManager(16, 64))


def test_a_whole_image_longer_than_a_step_is_refused():
    with pytest.raises(ValueError, match="computes in one step; max_num_batched_tokens is 8"):
        check([feature([(0, 6, 0), (10, 6, 6)], whole=True)], budget=8)


def test_a_text_only_model_refuses_images_in_the_core_and_the_front_end():
    with pytest.raises(ValueError, match="takes text only"):
        check([feature([(2, 8, 0)])], takes_images=False)
    inputs = InputProcessor(None, 100, 64, lambda n, k: None)
    with pytest.raises(ValueError, match="This model takes text only: multi_modal_data"):
        inputs.process_prompt({"prompt": "hi", "multi_modal_data": {"image": []}})

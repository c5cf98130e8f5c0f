"""Smoke test of benchmarks/multimodal_cache.py on the tiny LLaVA fixture (no timing asserted):
each measurement hits the caches it is meant to show, and the chart is drawn from its lines."""

from __future__ import annotations

import json

import pytest

from benchmarks import mm_checkpoint, multimodal_cache, multimodal_cache_plot
from tests.integration.vlm_fixtures import tiny_vlm_folder

pytestmark = pytest.mark.slow  # loads a model


def test_cache_measurements_and_chart(tmp_path_factory, smollm2_gguf, tmp_path):
    folder = tiny_vlm_folder(tmp_path_factory, smollm2_gguf, "llava")
    out = tmp_path / "mm.jsonl"
    rows = multimodal_cache.main(["--model", folder, "--repeats", "2", "--batch", "3", "--json-out", str(out)])
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    by = {(r["measure"], r.get("repeat")): r for r in rows}
    for rep in (0, 1):
        miss, same = by["a_miss", rep], by["b_same", rep]
        n, start, block = miss["prompt_tokens"], miss["image_start"], 16  # the engine's default block size
        assert miss["num_cached_tokens"] == 0 and miss["images_encoded"] == 1 and miss["encoder_s"] > 0
        assert same["num_cached_tokens"] == (n - 1) // block * block and same["images_encoded"] == 0
        before = by["c_text_before", rep]
        assert before["num_cached_tokens"] == 0 and (before["images_encoded"], before["hits"]) == (0, 1)
        after = by["c_text_after", rep]
        assert after["num_cached_tokens"] >= start + miss["image_tokens"] - block and after["images_encoded"] == 0
        other = by["d_other_image", rep]
        assert other["num_cached_tokens"] == start // block * block and other["images_encoded"] == 1
        batch = by["batch3", rep]
        assert batch["images_encoded"] == 3 and batch["images_per_s"] > 0
    chart = multimodal_cache_plot.plot([str(out)], str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 1000 and chart.endswith("c.png")
    assert multimodal_cache.summary(rows, 3).count("\n") == len(multimodal_cache.ORDER) + 1


def test_checkpoint_shapes_are_checked():
    assert mm_checkpoint.vision_shape(336)["num_attention_heads"] == 12
    with pytest.raises(ValueError, match="not a multiple of the patch size"):
        mm_checkpoint.vision_shape(330)
    with pytest.raises(ValueError, match="multiple of 64"):
        mm_checkpoint.vision_shape(336, hidden=400)

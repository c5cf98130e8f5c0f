"""The tiny VLM fixtures (vlm_fixtures.py) are what the image-input parity tests stand on: each
loads offline with transformers' own classes, expands its image markers into the number of image
tokens its processor's outputs imply, and generates tokens that depend on the image (so a parity
test fails if an engine ignores the image) and on the order of several images.

transformers' outputs on the fixtures are stored (tests/references.py, `vlm_fixtures.*`), as every
VLM parity test's are; `test_fixture_loads_and_depends_on_the_image` computes its references live
every run, one per family: each arch's check (LLaVA 1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Gemma 3,
Idefics3 for Idefics3/SmolVLM) that the store has not drifted from transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration import vlm_fixtures as vf
from tests.references import reference

pytestmark = pytest.mark.slow  # builds and runs models: not in the quick `not slow` tier

CLASSES = {"llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration",
           "qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
           "gemma3": "Gemma3ForConditionalGeneration", "idefics3": "Idefics3ForConditionalGeneration"}
WIDE = (96, 40)  # aspect 2.4: anyres grid, Qwen's dynamic resolution, Idefics3's 1x2 split, pan-and-scan


def image_token_count(arch: str, inputs) -> int:
    """How many image tokens the processor's tensors stand for, from the tensors alone (what an
    engine computes to place the vision tower's output); see /work/notes/vlm-arch-notes.md."""
    if arch == "llava":
        return 16 * inputs["pixel_values"].shape[0]  # (32 / 8)^2 patches, CLS dropped
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        return int(inputs["image_grid_thw"].prod(-1).sum()) // 4  # 2x2 patches merged per token
    if arch == "gemma3":
        return 16 * inputs["pixel_values"].shape[0]  # one row per image and per pan-and-scan crop
    if arch == "idefics3":
        real = inputs["pixel_attention_mask"].flatten(0, 1).any(-1).any(-1)  # padding crops are all-zero
        return 4 * int(real.sum())
    raise ValueError(f"no token count rule for {arch!r}")


@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_fixture_loads_and_depends_on_the_image(tiny_vlm, arch):
    import transformers as tf

    path = tiny_vlm(arch)
    processor, model = vf.load_reference(path)
    assert type(model).__name__ == CLASSES[arch]
    assert isinstance(model, getattr(tf, CLASSES[arch]))
    assert (Path(path) / "model.safetensors").exists() and (Path(path) / "chat_template.jinja").exists()
    cls = type(processor).__name__
    if cls.startswith("Qwen2") and not tf.utils.is_torchvision_available():
        with pytest.raises(OSError, match="video processor"):
            tf.AutoProcessor.from_pretrained(path)  # why load_processor exists; gone once torchvision is
    else:
        assert type(tf.AutoProcessor.from_pretrained(path)).__name__ == cls
    assert json.loads((Path(path) / "processor_config.json").read_text())["processor_class"] == cls

    text_config = model.config.get_text_config()
    tok = processor.tokenizer
    assert text_config.vocab_size == len(tok) and model.config.image_token_id < len(tok)
    assert model.generation_config.eos_token_id == tok.eos_token_id

    prompt = vf.chat_prompt(path, vf.user_turn("Describe the picture."))
    a, b = vf.sample_images(2, seed=3)
    ids = vf.hf_prompt_ids(path, prompt, [a])
    if arch != "llava_next":  # its count depends on the original size (notes); checked below
        assert ids.count(model.config.image_token_id) == image_token_count(arch, vf.processor_inputs(path, prompt, [a]))
    # the family's live check: computed now, it must equal the stored value
    out_a, out_b = vf.stored_greedy(f"vlm_fixtures.depends_on_the_image.{arch}", path, [(prompt, [a]), (prompt, [b])],
                                    6, live=True)
    assert len(out_a) == 6 and out_a != out_b, "generation must depend on the image"
    assert vf.hf_greedy(path, prompt, [a], 6) == out_a


@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_several_images_in_one_prompt(tiny_vlm, arch):
    path = tiny_vlm(arch)
    a, b = vf.sample_images(2, seed=5)
    (c,) = vf.sample_images(1, seed=6, size=WIDE)
    prompt = vf.chat_prompt(path, vf.user_turn("Compare them.", num_images=2))
    image_id = vf.image_token_id(path)
    one = [vf.hf_prompt_ids(path, vf.chat_prompt(path, vf.user_turn("x")), [im]).count(image_id) for im in (a, c)]
    assert vf.hf_prompt_ids(path, prompt, [a, c]).count(image_id) == sum(one)
    if arch != "llava_next":
        assert sum(one) == image_token_count(arch, vf.processor_inputs(path, prompt, [a, c]))
    ab, ba = vf.stored_greedy(f"vlm_fixtures.image_order.{arch}", path, [(prompt, [a, b]), (prompt, [b, a])], 6)
    assert ab != ba, "image order must matter"


def test_dynamic_resolutions(tiny_vlm):
    """Non-square images take the arch's own path: more tokens than a square one where it tiles."""
    square, = vf.sample_images(1, seed=1, size=(64, 64))
    wide, = vf.sample_images(1, seed=1, size=WIDE)

    def count(arch, image, **kwargs):
        path = tiny_vlm(arch)
        prompt = vf.chat_prompt(path, vf.user_turn("x"))
        ids = vf.hf_prompt_ids(path, prompt, [image], kwargs or None)
        return ids.count(vf.image_token_id(path)), vf.processor_inputs(path, prompt, [image], kwargs)

    n, inputs = count("qwen2_vl", wide)
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 12]] and n == 12  # 96x40 -> 96x32 pixels: 4x12 patches
    n_wide, inputs = count("llava_next", wide)
    n_square, _ = count("llava_next", square)
    assert inputs["image_sizes"].tolist() == [[40, 96]] and n_wide != n_square
    path = tiny_vlm("idefics3")
    ids = vf.hf_prompt_ids(path, vf.chat_prompt(path, vf.user_turn("x")), [wide])
    tok = vf.cached_processor(path).tokenizer
    assert tok.convert_tokens_to_ids("<row_1_col_2>") in ids and tok.convert_tokens_to_ids("<global-img>") in ids
    n_plain, _ = count("gemma3", wide)
    n_pas, inputs = count("gemma3", wide, **vf.PAN_AND_SCAN)
    # num_crops is dropped from the outputs (Gemma3Processor.unused_input_names): one row per image or crop
    assert n_plain == 16 and inputs["pixel_values"].shape[0] == 3 and n_pas == 16 * 3


def test_greedy_choices_are_not_near_ties(tiny_vlm):
    """The parity tests compare greedy tokens: a margin this wide survives float rounding. The
    gaps between transformers' top two logits are stored (`vlm_fixtures.greedy_gaps.<arch>`)."""
    for arch in sorted(CLASSES):
        path = tiny_vlm(arch)
        prompt, images = vf.chat_prompt(path, vf.user_turn("Describe.")), vf.sample_images(1, 7)

        def top2_gaps(path=path, prompt=prompt, images=images) -> list[float]:
            _, model = vf.load_reference(path)
            inputs = vf.processor_inputs(path, prompt, images)
            with torch.no_grad():
                out = model.generate(**inputs, do_sample=False, max_new_tokens=8, output_scores=True,
                                     return_dict_in_generate=True)
            return [float(s[0].topk(2).values.diff().abs()) for s in out.scores]

        gaps = reference(f"vlm_fixtures.greedy_gaps.{arch}", top2_gaps, sources=[path],
                         inputs=vf.case_inputs([(prompt, images)], max_new_tokens=8, scores="top-2 gap"))
        assert min(gaps) > 1e-3, (arch, gaps)


def test_unknown_arch_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny VLM arch 'pixtral'"):
        vf.make_tiny_vlm("pixtral", tmp_path)

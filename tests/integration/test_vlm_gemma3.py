"""Gemma 3 multimodal (`Gemma3ForConditionalGeneration`) on pagedllm's engine against
transformers' float32 greedy with the same images, token for token: one image, two images,
pan-and-scan crops, a prefill budget smaller than the prompt (images kept whole in a chunk),
a prefix-cache hit that ends inside an image, a text-only prompt; and the two things the
parity rests on, shown to matter: attention inside an image is bidirectional, and a chunk
cut inside an image would change the output.

transformers' side is read from the reference store (tests/references.py, `vlm_gemma3.*`;
test_vlm_fixtures.py computes the family's references live, the check against drift)."""

from __future__ import annotations


import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.layers.backends import triton_attention_kernels
from pagedllm.model.vision_gemma3 import Gemma3VisionEncoder
from pagedllm.multimodal.image_spec_gemma3 import Gemma3Spec
from tests.integration import vlm_fixtures as vf

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# Images: two 48x40 (no crops without pan-and-scan; 2 crops with it: ratio 1.2), a wide 96x32
# one (3 crops) and a square 40x40 one (never cropped).
IMAGES = vf.sample_images(2)
WIDE = vf.sample_images(1, seed=3, size=(96, 32))[0]
SQUARE = vf.sample_images(1, seed=5, size=(40, 40))[0]
CHUNK_BUDGET = 20  # the first image's 16 soft tokens sit at 5..21: a plain cut at 20 falls inside


@pytest.fixture(scope="module")
def folder(tiny_vlm) -> str:
    return tiny_vlm("gemma3")


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(model=folder, num_kv_blocks=96)


@pytest.fixture(scope="module")
def chunked_llm(folder):
    return LLM(model=folder, num_kv_blocks=96, max_num_batched_tokens=CHUNK_BUDGET)


def _request(path: str, text: str, images: list) -> tuple[str, dict | str]:
    prompt = vf.chat_prompt(path, vf.user_turn(text, len(images)))
    return prompt, ({"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt)


def _check(name: str, llm: LLM, path: str, cases: list[tuple[str, list]], processor_kwargs: dict | None = None) -> list:
    """Generate every case in one batch; each must equal transformers' greedy tokens (stored
    under `vlm_gemma3.<name>`; the outputs are returned)."""
    prompts, requests = zip(*(_request(path, text, images) for text, images in cases))
    outs = llm.generate(list(requests), GREEDY, use_tqdm=False)
    wants = vf.stored_greedy(f"vlm_gemma3.{name}", path, [(p, images) for p, (_, images) in zip(prompts, cases)],
                             MAX_TOKENS, processor_kwargs)
    for (text, images), prompt, out, want in zip(cases, prompts, outs, wants):
        assert list(out.prompt_token_ids) == vf.hf_prompt_ids(path, prompt, images, processor_kwargs), text
        assert list(out.outputs[0].token_ids)[:len(want)] == want, (text, len(images))
    return outs


def test_one_image_each_and_text_only_match_transformers(llm, folder):
    outs = _check("one_image_each_and_text", llm, folder, [("What is this?", IMAGES[:1]),
                                                           ("What is this?", IMAGES[1:]),
                                                           ("Just text, no image at all.", [])])
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the image decides the answer


def test_two_images_in_one_prompt_match_transformers(llm, folder):
    _check("two_images", llm, folder, [("Compare the two.", IMAGES), ("Compare the two.", IMAGES[::-1])])


def test_pan_and_scan_crops_match_transformers(folder):
    """A wide image (original + 3 crops: four blocks, text between) beside an uncropped one:
    each image's feature has one run per block and all its crops' pixels. Pan-and-scan is
    switched on as vLLM does it: `mm_processor_kwargs`."""
    from transformers import AutoConfig

    from pagedllm.multimodal.processing import MultiModalProcessor

    prompt, _ = _request(folder, "Describe both.", [WIDE, SQUARE])
    proc = MultiModalProcessor(folder, AutoConfig.from_pretrained(folder), "Gemma3ForConditionalGeneration",
                               processor_kwargs=vf.PAN_AND_SCAN)
    _, features = proc.process(prompt, {"image": [WIDE, SQUARE]})
    assert [len(f.runs) for f in features] == [4, 1]
    assert [f.data["pixel_values"].shape[0] for f in features] == [4, 1]
    assert all(f.whole_in_one_chunk for f in features)
    llm = LLM(model=folder, num_kv_blocks=96, mm_processor_kwargs=vf.PAN_AND_SCAN)
    _check("pan_and_scan", llm, folder, [("Describe both.", [WIDE, SQUARE]), ("What is this?", IMAGES[:1])],
           processor_kwargs=vf.PAN_AND_SCAN)


def test_chunked_prefill_keeps_images_whole_and_matches_transformers(chunked_llm, folder):
    prompt, _ = _request(folder, "What is this?", IMAGES[:1])
    ids = vf.hf_prompt_ids(folder, prompt, IMAGES[:1])
    image_token = vf.image_token_id(folder)
    first = ids.index(image_token)
    assert first < CHUNK_BUDGET < first + 16 and len(ids) > CHUNK_BUDGET  # a plain cut lands inside
    _check("chunked_prefill", chunked_llm, folder, [("What is this?", IMAGES[:1]), ("Compare the two.", IMAGES),
                                                    ("Just text, no image at all.", [])])


def test_prefix_cache_hit_inside_an_image_matches_transformers(llm, folder):
    """The same image then other text: the cached block [0, 16) ends inside the image (5..21),
    so the second prompt's chunk starts inside it and still matches."""
    llm.reset_prefix_cache()
    _check("prefix_cache_first", llm, folder, [("Tell me about it.", IMAGES[1:])])
    out = _check("prefix_cache_hit", llm, folder, [("Something else entirely, please.", IMAGES[1:])])[0]
    assert out.num_cached_tokens == 16


def test_causal_attention_inside_an_image_would_differ(llm, folder, monkeypatch):
    """Without the bidirectional spans (a causal mask everywhere) the engine leaves transformers."""
    monkeypatch.setattr(Gemma3VisionEncoder, "bidirectional_images", False)
    prompt, request = _request(folder, "Which colours?", IMAGES[:1])
    llm.reset_prefix_cache()
    got = list(llm.generate([request], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    assert got != vf.stored_greedy("vlm_gemma3.causal_would_differ", folder, [(prompt, IMAGES[:1])], MAX_TOKENS)[0]


def test_a_chunk_cut_inside_an_image_would_differ(chunked_llm, folder, monkeypatch):
    """With images not kept whole, the budget cuts the first image at 20: its first queries
    never see its last keys, and the output leaves transformers'."""
    monkeypatch.setattr(Gemma3Spec, "whole_in_one_chunk", False)
    prompt, request = _request(folder, "Which shapes?", IMAGES[:1])
    chunked_llm.reset_prefix_cache()
    got = list(chunked_llm.generate([request], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    assert got != vf.stored_greedy("vlm_gemma3.chunk_cut_would_differ", folder, [(prompt, IMAGES[:1])],
                                   MAX_TOKENS)[0]


@pytest.mark.skipif(not triton_attention_kernels.HAS_TRITON, reason="triton is not installed")
def test_triton_backend_matches_transformers(folder, monkeypatch):
    """The Triton backend (its interpreter on CPU): a causal varlen kernel, then the sequences
    with image spans recomputed with their mask; chunked as above."""
    import torch

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = LLM(model=folder, num_kv_blocks=64, attention_backend="triton", max_num_batched_tokens=CHUNK_BUDGET)
    prompt, request = _request(folder, "What is this?", IMAGES[:1])
    got = list(llm.generate([request], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids)
    assert got == vf.stored_greedy("vlm_gemma3.triton", folder, [(prompt, IMAGES[:1])], 6)[0]

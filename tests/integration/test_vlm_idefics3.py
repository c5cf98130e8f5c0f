"""Idefics3 and SmolVLM (SigLIP-style crops, pixel-shuffle connector, Llama) on the paged engine:
greedy equal to transformers' float32 `generate` token for token with one image, two images of
different sizes (2x2 and 1x2 crops plus their global images: one run of `<image>` per crop, text
tokens between), a text-only prompt, and prefill chunks of 7 tokens whose boundaries fall inside
an image's crop runs. SmolVLM's fixture has its own model classes and Idefics3's processor
(vlm_fixtures._smolvlm). transformers' side is read from the reference store (tests/references.py;
test_vlm_fixtures.py computes Idefics3's references live, the family's check against drift)."""

from __future__ import annotations

import pytest

from tests.integration import vlm_fixtures as vf
from tests.integration import vlm_greedy_cases as vc

pytestmark = pytest.mark.slow  # loads a model: not in the quick `not slow` tier

CHUNK = 7
# (fixture, max_num_batched_tokens): Idefics3 in one chunk and chunked, SmolVLM chunked.
SETUPS = [("idefics3", None), ("idefics3", CHUNK), ("smolvlm", CHUNK)]


@pytest.fixture(scope="module", params=SETUPS, ids=lambda s: f"{s[0]}-{'chunked' if s[1] else 'one-chunk'}")
def setup(request, tmp_path_factory, smollm2_gguf):
    """(folder, cases, LLM) of one setup; a fixture's references are computed once."""
    from pagedllm import LLM

    arch, chunk = request.param
    path = vf.tiny_vlm_folder(tmp_path_factory, smollm2_gguf, arch)
    if path not in _CASES:
        _CASES[path] = vc.cases(path)
    cases = _CASES[path]
    return path, cases, LLM(model=path, num_kv_blocks=96, max_num_batched_tokens=chunk)


_CASES: dict[str, dict] = {}


def _image_id(path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).image_token_id


def test_one_image_each(setup):
    _, cases, llm = setup
    chosen = [cases["one_a"], cases["one_b"]]
    assert chosen[0].expected != chosen[1].expected  # the image decides the output
    assert vc.greedy(llm, chosen) == [c.expected for c in chosen]


def test_two_images_of_different_sizes(setup):
    path, cases, llm = setup
    two = cases["two"]
    runs = "".join("x" if t == _image_id(path) else " " for t in two.prompt_ids).split()
    assert len(runs) == 5 + 3  # 2x2 crops + global, then 1x2 crops + global: one run per crop
    assert vc.greedy(llm, [two]) == [two.expected]


def test_text_only(setup):
    _, cases, llm = setup
    assert vc.greedy(llm, [cases["text"]]) == [cases["text"].expected]


def test_chunk_boundary_inside_the_image(setup):
    path, cases, _ = setup
    (start, end), = vc.image_spans(cases["one_a"].prompt_ids, _image_id(path))
    assert any(start < k * CHUNK < end for k in range(1, end // CHUNK + 1))


def test_an_image_is_the_same_feature_in_any_prompt(setup):
    """Each image takes its own crops (5, then 3) of the prompt's stacked `pixel_values`, one run per
    crop, and hashes the same as in a prompt of its own."""
    path, cases, _ = setup
    first, wide = vc.features(path, cases["two"])
    assert [first.data["pixel_values"].shape[1], wide.data["pixel_values"].shape[1]] == [5, 3]
    assert [len(first.runs), len(wide.runs)] == [5, 3]
    assert first.content_hash == vc.features(path, cases["one_a"])[0].content_hash

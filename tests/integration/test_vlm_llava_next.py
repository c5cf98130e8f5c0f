"""LLaVA-NeXT (anyres tiles, `image_newline`) on the paged engine: greedy equal to transformers'
float32 `generate` token for token with one image, two images of different sizes (different tile
grids: the smaller one keeps only its own tiles of the padded `pixel_values`), a text-only
prompt, and prefill chunks of 7 tokens whose boundaries fall inside the image's run.
transformers' side is read from the reference store (tests/references.py; test_vlm_fixtures.py
computes the family's references live, the check against drift)."""

from __future__ import annotations

import pytest

from tests.integration import vlm_fixtures as vf
from tests.integration import vlm_greedy_cases as vc

pytestmark = pytest.mark.slow  # loads a model: not in the quick `not slow` tier

CHUNK = 7


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_gguf):
    return vf.tiny_vlm_folder(tmp_path_factory, smollm2_gguf, "llava_next")


@pytest.fixture(scope="module")
def cases(folder):
    return vc.cases(folder)


@pytest.fixture(scope="module", params=["one-chunk", "chunked"])
def llm(request, folder):
    from pagedllm import LLM

    chunk = {"chunked": CHUNK, "one-chunk": None}[request.param]
    return LLM(model=folder, num_kv_blocks=96, max_num_batched_tokens=chunk)


def test_one_image_each(llm, cases):
    chosen = [cases["one_a"], cases["one_b"]]
    assert chosen[0].expected != chosen[1].expected  # the image decides the output
    assert vc.greedy(llm, chosen) == [c.expected for c in chosen]


def test_two_images_of_different_sizes(llm, cases, folder):
    from transformers import AutoConfig

    two = cases["two"]
    image_id = AutoConfig.from_pretrained(folder).image_token_index
    runs = [len(r) for r in "".join("x" if t == image_id else " " for t in two.prompt_ids).split()]
    assert len(runs) == 2 and runs[0] != runs[1]  # anyres gives the two images different row counts
    assert vc.greedy(llm, [two]) == [two.expected]


def test_text_only(llm, cases):
    assert vc.greedy(llm, [cases["text"]]) == [cases["text"].expected]


def test_chunk_boundary_inside_the_image(cases, folder):
    from transformers import AutoConfig

    image_id = AutoConfig.from_pretrained(folder).image_token_index
    (start, end), = vc.image_spans(cases["one_a"].prompt_ids, image_id)
    assert any(start < k * CHUNK < end for k in range(1, end // CHUNK + 1))


def test_an_image_is_the_same_feature_in_any_prompt(folder, cases):
    """The wide image's `pixel_values` come padded to the square one's 5 tiles: it keeps its own 3,
    so an image's content hash (encoder cache, prefix cache) does not depend on its neighbours."""
    alone, = vc.features(folder, vc.Case(cases["one_a"].prompt, cases["two"].images[1:]))
    first, wide = vc.features(folder, cases["two"])
    assert wide.data["pixel_values"].shape[1] == 3 and first.data["pixel_values"].shape[1] == 5
    assert wide.content_hash == alone.content_hash
    assert first.content_hash == vc.features(folder, cases["one_a"])[0].content_hash

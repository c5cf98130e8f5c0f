"""Qwen2-VL and Qwen2.5-VL on the paged engine (issue 45): greedy output equal to transformers'
float32 `generate` token for token with the same images, on tiny random checkpoints
(vlm_fixtures.py): one image, two images of different sizes (dynamic resolution, M-RoPE across
both), a text-only prompt, prefill chunks that end inside an image, preemption by recompute,
and the prefix cache. Decode steps run in the C decode step (1-D positions + rope delta).

transformers' side is read from the reference store (tests/references.py, `vlm_qwen2_vl.<arch>.*`;
test_vlm_fixtures.py computes each family's references live, the check against drift).
"""

from __future__ import annotations

import pytest

from tests.integration.vlm_fixtures import (
    chat_prompt,
    hf_prompt_ids,
    image_token_id,
    sample_images,
    stored_greedy,
    tiny_vlm_folder,
    user_turn,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
CHUNK = 5  # max_num_batched_tokens of the chunked engine: boundaries fall inside every image
# non-square images of different sizes (width, height): 6, 10 and 8 image tokens
IMAGES = [sample_images(1, seed=s, size=size)[0] for s, size in ((1, (48, 40)), (2, (80, 36)), (3, (40, 64)))]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def folder(request, tmp_path_factory, smollm2_gguf) -> str:
    return tiny_vlm_folder(tmp_path_factory, smollm2_gguf, request.param)


def _arch(folder: str) -> str:
    import json

    with open(f"{folder}/config.json", encoding="utf-8") as f:
        return json.load(f)["model_type"]


def _cases(folder: str) -> list[tuple[str, list]]:
    one = chat_prompt(folder, user_turn("What is this?", 1))
    two = chat_prompt(folder, user_turn("Compare them.", 2))
    text = chat_prompt(folder, user_turn("Say something about squares.", 0))
    return [(one, [IMAGES[0]]), (one, [IMAGES[1]]), (two, [IMAGES[1], IMAGES[2]]), (two, [IMAGES[2], IMAGES[0]]),
            (text, [])]


def _generate(llm, cases: list[tuple[str, list]]) -> list[list[int]]:
    from pagedllm import SamplingParams

    prompts = [{"prompt": p, "multi_modal_data": {"image": ims}} if ims else p for p, ims in cases]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _assert_parity(name: str, folder: str, llm, cases: list[tuple[str, list]]) -> None:
    """Our greedy tokens equal transformers' (stored as `vlm_qwen2_vl.<arch>.<name>`)."""
    ours = _generate(llm, cases)
    wants = stored_greedy(f"vlm_qwen2_vl.{_arch(folder)}.{name}", folder, cases, MAX_TOKENS)
    for i, ((prompt, images), got, want) in enumerate(zip(cases, ours, wants, strict=True)):
        assert got == want, f"case {i} ({len(images)} images): ours {got} != transformers {want}"


def _llm(folder: str, **kwargs):
    from pagedllm import LLM

    return LLM(folder, **kwargs)


@pytest.fixture(scope="module")
def llm(folder):
    engine = _llm(folder, num_kv_blocks=64)
    yield engine
    engine.shutdown()


def test_greedy_parity_images_and_text(folder, llm):
    cases = _cases(folder)
    _assert_parity("cases", folder, llm, cases)
    # the output depends on the image (an engine that ignored it could not match both)
    first, second = _generate(llm, cases[:2])
    assert first != second
    runner = llm.llm_engine.model_runner
    assert runner.mrope and runner.cpu_decode_step is not None and runner.cpu_decode_step.steps > 0


def test_prefix_cache_hits_keep_positions(folder, llm):
    # the same two-image prompt again, then with the images swapped: hits only where both match
    prompt = chat_prompt(folder, user_turn("Compare them again, in detail please.", 2))
    cases = [(prompt, [IMAGES[0], IMAGES[1]])]
    _assert_parity("prefix_cache_first", folder, llm, cases)
    before = llm.kv_cache_stats().prefix_cache_hits
    _assert_parity("prefix_cache_swapped", folder, llm, cases + [(prompt, [IMAGES[1], IMAGES[0]])])
    assert llm.kv_cache_stats().prefix_cache_hits > before


def _chunk_ends_inside_image(folder: str, prompt: str, images: list) -> bool:
    ids = hf_prompt_ids(folder, prompt, images)
    image_token = image_token_id(folder)
    return any(ids[end - 1] == image_token and ids[end] == image_token for end in range(CHUNK, len(ids), CHUNK))


def test_chunked_prefill_inside_images(folder):
    cases = _cases(folder)
    assert all(_chunk_ends_inside_image(folder, p, ims) for p, ims in cases if ims)
    # one sequence at a time: its chunks are exactly [0, CHUNK), [CHUNK, 2 CHUNK), ...
    engine = _llm(folder, num_kv_blocks=64, max_num_batched_tokens=CHUNK, max_num_seqs=1,
                  enable_prefix_caching=False)
    try:
        _assert_parity("cases", folder, engine, cases)
    finally:
        engine.shutdown()


def test_preemption_by_recompute(folder):
    # each request needs 4-5 blocks of 8 at its end, all five 22: a pool of 10 preempts
    cases = _cases(folder)
    engine = _llm(folder, num_kv_blocks=10, block_size=8, enable_prefix_caching=False)
    try:
        _assert_parity("cases", folder, engine, cases)
        stats = engine.kv_cache_stats()
        assert stats.num_preemptions > 0 and stats.used_blocks == 0
    finally:
        engine.shutdown()

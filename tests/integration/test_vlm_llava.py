"""LLaVA 1.5 on the paged engine (docs/multimodal.md): greedy equal to transformers' float32
generate given the same images, in every engine mode: one chunk, a chunk boundary inside an
image, prefix-cache hits on a shared image (and none across different images), preemption,
parallel samples and beams; bad image inputs refused by name while the engine goes on.

transformers' side is read from the reference store (tests/references.py, `vlm_llava.*`;
test_vlm_fixtures.py computes the family's references live, the check against drift)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.integration.vlm_fixtures import case_inputs, chat_prompt, hf_prompt_ids, sample_images, stored_greedy, \
    tiny_vlm_folder, user_turn
from tests.references import reference

pytestmark = pytest.mark.slow

MAX = 10
GREEDY = SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tmp_path_factory, smollm2_gguf) -> str:
    return tiny_vlm_folder(tmp_path_factory, smollm2_gguf, "llava")


@pytest.fixture(scope="module")
def llm(llava) -> LLM:
    return LLM(model=llava, num_kv_blocks=64, block_size=8, max_num_batched_tokens=256)


def prompt_of(folder: str, text: str, num_images: int = 1) -> str:
    return chat_prompt(folder, user_turn(text, num_images))


def generate(llm: LLM, prompts: list[tuple[str, list]], params: SamplingParams = GREEDY):
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": imgs}} for p, imgs in prompts], params,
                        use_tqdm=False)
    return outs


def hf_reference(name: str, folder: str, prompts: list[tuple[str, list]], max_tokens: int = MAX) -> list[list[int]]:
    """transformers' greedy tokens of `prompts`, stored as `vlm_llava.<name>`."""
    return stored_greedy(f"vlm_llava.{name}", folder, prompts, max_tokens)


def test_greedy_equals_transformers_and_depends_on_the_image(llava, llm):
    images = sample_images(3, seed=1)
    prompts = [(prompt_of(llava, "What is in the picture?"), [im]) for im in images]
    outs = generate(llm, prompts)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == hf_reference("greedy_depends_on_the_image", llava, prompts)
    assert len({tuple(g) for g in got}) == 3  # the image changes the answer
    assert list(outs[0].prompt_token_ids) == hf_prompt_ids(llava, *prompts[0])


def test_two_images_in_one_prompt(llava, llm):
    a, b = sample_images(2, seed=2)
    prompts = [(prompt_of(llava, "Compare them.", 2), [a, b]), (prompt_of(llava, "Compare them.", 2), [b, a])]
    got = [list(o.outputs[0].token_ids) for o in generate(llm, prompts)]
    assert got == hf_reference("two_images", llava, prompts) and got[0] != got[1]


def test_a_chunk_boundary_inside_an_image(llava):
    """Chunks of 5 tokens: three boundaries fall inside the 16-row image span; the image is
    encoded once and each chunk takes its rows."""
    engine = LLM(model=llava, num_kv_blocks=64, block_size=8, max_num_batched_tokens=5,
                 enable_prefix_caching=False)
    prompts = [(prompt_of(llava, "Describe."), [im]) for im in sample_images(2, seed=3)]
    assert [list(o.outputs[0].token_ids) for o in generate(engine, prompts)] == \
        hf_reference("chunk_boundary", llava, prompts)
    enc = engine.llm_engine.core.scheduler.encoder_cache
    assert enc.images_encoded == 2 and enc.rows_encoded == 32


def test_the_same_image_twice_skips_its_encoding_and_prefill(llava, llm):
    """A second request with the same prompt and image: its prompt blocks come from the prefix
    cache and nothing is encoded again; the same text with another image hits only the blocks
    before the image."""
    im, other = sample_images(2, seed=4)
    prompt = prompt_of(llava, "Once more?")
    enc = llm.llm_engine.core.scheduler.encoder_cache
    (first,) = generate(llm, [(prompt, [im])])
    encoded = enc.images_encoded
    (second,) = generate(llm, [(prompt, [im])])
    assert enc.images_encoded == encoded  # no encoder work
    n = len(second.prompt_token_ids)
    assert second.num_cached_tokens == (n - 1) // 8 * 8  # every full block but the last token's
    assert list(second.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    (third,) = generate(llm, [(prompt, [other])])
    start = list(third.prompt_token_ids).index(llm.llm_engine.inputs.multimodal.image_token_id)
    assert third.num_cached_tokens == start // 8 * 8  # only the blocks before the image
    assert enc.images_encoded == encoded + 1
    assert list(third.outputs[0].token_ids) == hf_reference("same_image_twice", llava, [(prompt, [other])])[0]


def test_preemption_under_a_small_pool(llava):
    """A pool too small for every request at once: requests are preempted (recomputed, their
    images encoded again or taken from the encoder cache) and still equal transformers."""
    engine = LLM(model=llava, num_kv_blocks=12, block_size=8, max_num_batched_tokens=64,
                 enable_prefix_caching=False)
    prompts = [(prompt_of(llava, f"Item {i}?"), [im]) for i, im in enumerate(sample_images(4, seed=5))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = generate(engine, prompts, params)
    assert engine.llm_engine.core.scheduler.num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_reference("preemption", llava, prompts, 24)


def test_parallel_samples_and_beams_share_the_image_prompt(llava, llm):
    import torch

    from tests.integration.vlm_fixtures import load_reference, processor_inputs

    (im,) = sample_images(1, seed=6)
    prompt = prompt_of(llava, "Two ways?")
    (out,) = generate(llm, [(prompt, [im])], SamplingParams(n=2, max_tokens=MAX, temperature=0.0, ignore_eos=True))
    ref = hf_reference("parallel_samples", llava, [(prompt, [im])])[0]
    assert [list(c.token_ids) for c in out.outputs] == [ref, ref]
    from pagedllm import BeamSearchParams

    beams = llm.beam_search([{"prompt": prompt, "multi_modal_data": {"image": [im]}}],
                            BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True), use_tqdm=False)
    beam_params = dict(do_sample=False, num_beams=2, num_return_sequences=2, max_new_tokens=6, early_stopping=True,
                       length_penalty=1.0)

    def hf_beams() -> list[list[int]]:
        _, model = load_reference(llava)
        inputs = processor_inputs(llava, prompt, [im])
        with torch.no_grad():
            hf = model.generate(**inputs, **beam_params)
        n = inputs["input_ids"].shape[1]
        return [row[n:].tolist() for row in hf]

    want = reference("vlm_llava.beams", hf_beams, sources=[llava], inputs=case_inputs([(prompt, [im])], **beam_params))
    assert [list(c.token_ids) for c in beams[0].outputs] == want


@pytest.mark.slow
def test_tensor_parallel_two_ranks(llava):
    """TP=2: each rank runs the whole vision tower and its half of the language model."""
    engine = LLM(model=llava, num_kv_blocks=64, block_size=8, tensor_parallel_size=2, max_num_batched_tokens=9)
    try:
        prompts = [(prompt_of(llava, "Split?"), [im]) for im in sample_images(2, seed=8)]
        assert [list(o.outputs[0].token_ids) for o in generate(engine, prompts)] == \
            hf_reference("tensor_parallel", llava, prompts)
    finally:
        engine.llm_engine.core.executor.shutdown()


def test_bad_image_inputs_are_refused_by_name_and_the_engine_goes_on(llava, llm):
    from PIL import Image

    (im,) = sample_images(1, seed=7)
    prompt = prompt_of(llava, "Fine?")
    with pytest.raises(ValueError, match="Found total 1 <image> tokens and 2 images"):  # one placeholder, two images
        generate(llm, [(prompt, [im, im])])
    with pytest.raises(ValueError, match="must be a PIL.Image.Image"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": b"\x89PNG"}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="video inputs are not supported"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"video": [im]}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="'prompt_token_ids' with images is not supported"):
        llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": [im]}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="image placeholder but no image"):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="no images were passed"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": []}}, GREEDY, use_tqdm=False)
    tiny = Image.new("RGB", (1, 1))  # the processor resizes any size; a 1x1 image is still an image
    assert len(generate(llm, [(prompt, [tiny])])[0].outputs[0].token_ids) == MAX
    core = llm.llm_engine.core
    assert not core.scheduler.has_unfinished() and not any(core.scheduler.encoder_cache.users.values())
    kv = core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks  # no block held by a refused request
    assert [list(o.outputs[0].token_ids) for o in generate(llm, [(prompt, [im])])] == \
        hf_reference("after_refusals", llava, [(prompt, [im])])


@pytest.mark.parametrize("spelling", ["transformers-5", "vision_model-wrapper"])
def test_both_checkpoint_spellings_load(llava, tmp_path, spelling):
    """transformers 5 saves LLaVA as 4 did (`language_model.model.*`, `vision_tower.*`); its
    in-memory names (`model.language_model.*`, `model.vision_tower.*`, `lm_head.*`) and hub
    checkpoints' CLIP wrapper (`vision_tower.vision_model.*`) must load the same."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / spelling
    shutil.copytree(llava, folder)
    renames = {"transformers-5": (("language_model.model.", "model.language_model."),
                                  ("language_model.lm_head.", "lm_head."), ("vision_tower.", "model.vision_tower."),
                                  ("multi_modal_projector.", "model.multi_modal_projector.")),
               "vision_model-wrapper": (("vision_tower.", "vision_tower.vision_model."),)}[spelling]
    state = load_file(folder / "model.safetensors")
    out = {}
    for key, tensor in state.items():
        new = next((n + key[len(o):] for o, n in renames if key.startswith(o)), key)
        out[new] = tensor
    assert set(out) != set(state)
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    engine = LLM(model=str(folder), num_kv_blocks=32, block_size=8)
    prompts = [(prompt_of(llava, "Names?"), [im]) for im in sample_images(1, seed=9)]
    assert [list(o.outputs[0].token_ids) for o in generate(engine, prompts)] == \
        hf_reference(f"checkpoint_spelling.{spelling}", llava, prompts)


def test_the_dashboard_state_shows_a_running_requests_image_span(llava, llm):
    """engine_state (the dashboard's snapshot): a request's image span and hash, and the
    encoder-cache counters."""
    (im,) = sample_images(1, seed=10)
    prompt = prompt_of(llava, "Where?")
    engine = llm.llm_engine
    engine.add_request("dash-1", {"prompt": prompt, "multi_modal_data": {"image": [im]}},
                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    try:
        engine.step()
        state = engine.core.engine_state()
        (req,) = [r for r in state["requests"] if r["id"] == "dash-1"]
        (feature,) = engine.core.requests["dash-1"].mm_features
        assert req["image_spans"] == [[feature.start, feature.end, feature.content_hash.hex()[:12]]]
        assert feature.end - feature.start == 16 and state["counters"]["mm_cache_queries"] >= 1
    finally:
        engine.abort_request("dash-1")
        while engine.has_unfinished_requests():
            engine.step()


def test_a_draft_model_is_refused_by_name_ngram_runs(llava):
    """A draft model would see the placeholders without the image: refused by name; n-gram
    speculation (token lookup only) runs and keeps greedy output equal."""
    with pytest.raises(ValueError, match="'draft_model' with an image model is not built"):
        LLM(model=llava, speculative_config={"method": "draft_model", "model": llava, "num_speculative_tokens": 2})
    engine = LLM(model=llava, num_kv_blocks=64, block_size=8,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    prompts = [(prompt_of(llava, "Again and again?"), [im]) for im in sample_images(1, seed=11)]
    assert [list(o.outputs[0].token_ids) for o in generate(engine, prompts)] == hf_reference("ngram", llava, prompts)

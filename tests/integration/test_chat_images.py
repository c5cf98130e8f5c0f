"""Offline `LLM.chat` with image parts end to end on the tiny random LLaVA (issue 45): an
`image_url` data URL, a file:// URL under allowed_local_media_path and an `image_pil` part give
transformers' own greedy tokens for the same rendered prompt and image (stored: tests/references.py,
`chat_images.image_parts`); the limit is enforced."""

from __future__ import annotations

import base64
import io

import pytest

from tests.integration.vlm_fixtures import chat_prompt, sample_images, stored_greedy, user_turn

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
QUESTION = "What is in the picture?"


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def llava(tiny_vlm):
    return tiny_vlm("llava")


def test_chat_image_parts_match_transformers(llava, tmp_path):
    from pagedllm import LLM
    from pagedllm.sampling_params import SamplingParams

    image = sample_images(1, seed=3)[0]
    (tmp_path / "img.png").write_bytes(_png(image))
    expected = stored_greedy("chat_images.image_parts", llava, [(chat_prompt(llava, user_turn(QUESTION, 1)), [image])],
                             MAX_TOKENS)[0]
    llm = LLM(model=llava, max_model_len=512, kv_cache_space=0.05, allowed_local_media_path=str(tmp_path),
              limit_mm_per_prompt={"image": 1})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    url = "data:image/png;base64," + base64.b64encode(_png(image)).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}},
             {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/img.png"}},
             {"type": "image_pil", "image_pil": image}]
    conversations = [[{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}] for part in parts]
    outs = llm.chat(conversations, params, use_tqdm=False)
    for out in outs:
        assert list(out.outputs[0].token_ids) == expected
    with pytest.raises(ValueError, match=r"At most 1 image\(s\)"):
        llm.chat([{"role": "user", "content": parts[:2]}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the allowed local media path"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}]}],
                 params, use_tqdm=False)

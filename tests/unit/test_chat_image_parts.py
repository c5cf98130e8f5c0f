"""Chat content parts with images (pagedllm/multimodal/chat_parts.py, the server's chat
protocol and chat path, the processor's chat template, limit_mm_per_prompt). No model needed:
the server test runs ChatServer against a stand-in engine that records the prompt it gets."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from types import SimpleNamespace

import pytest
from PIL import Image

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionRequest, ChatMessageParam
from pagedllm.multimodal.chat_parts import load_images, multimodal_prompt, parse_conversation
from pagedllm.multimodal.limits import DEFAULT_IMAGE_LIMIT, check_image_count, parse_limit_mm_per_prompt
from pagedllm.multimodal.media import MediaPolicy
from pagedllm.multimodal.model_info import folder_takes_images, processor_chat_template, takes_images

# A multimodal template in the shape of Qwen2-VL's: content lists, an image placeholder per part.
VLM_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _data_url(color=(255, 0, 0), size=(6, 4)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_part(url: str, detail: str | None = None) -> dict:
    spec = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": spec}


# ---------------------------------------------------------------- parsing


def test_vlm_messages_in_template_form_images_in_order():
    a, b = _data_url((255, 0, 0)), _data_url((0, 0, 255))
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [_image_part(a, "low"), {"type": "text", "text": "and"},
                                     _image_part(b)]},
        {"role": "assistant", "content": [{"type": "text", "text": "Two images."}]},
        {"role": "user", "content": [{"type": "text", "text": "Which is red?"}]},
    ]
    parsed = parse_conversation(conv, takes_images=True)
    assert parsed.messages == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Two images."}]},
        {"role": "user", "content": [{"type": "text", "text": "Which is red?"}]},
    ]
    assert [r.url for r in parsed.images] == [a, b]
    assert [r.detail for r in parsed.images] == ["low", None]
    assert conv[1]["content"][0]["type"] == "image_url"  # the caller's messages untouched
    images = load_images(parsed.images, MediaPolicy())
    assert [im.getpixel((0, 0)) for im in images] == [(255, 0, 0), (0, 0, 255)]
    prompt = multimodal_prompt("text", images)
    assert prompt == {"prompt": "text", "multi_modal_data": {"image": images}}


def test_text_model_keeps_strings_and_refuses_images():
    conv = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}], "name": "x"}]
    parsed = parse_conversation(conv, takes_images=False)
    assert parsed.messages == [{"role": "user", "content": "a\nb"},
                               {"role": "assistant", "content": "no", "name": "x"}]
    assert parsed.images == []
    bad = [{"role": "user", "content": [_image_part(_data_url())]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: content parts of type 'image_url' "
                                         r"are not supported: SmolLM2 takes text only"):
        parse_conversation(bad, takes_images=False, model_name="SmolLM2")


@pytest.mark.parametrize("kind", ["input_audio", "audio_url", "video_url", "file", "image_embeds", None])
def test_other_part_types_refused_by_name(kind):
    conv = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": kind}]}]
    for vlm in (True, False):
        with pytest.raises(ValueError, match=rf"content\[1\]: content parts of type {kind!r} are not "
                                             r"supported: pagedllm takes text and images"):
            parse_conversation(conv, takes_images=vlm)


def test_malformed_parts():
    def parse(content):
        return parse_conversation([{"role": "user", "content": content}], takes_images=True)

    with pytest.raises(ValueError, match="needs .*'url'.* non-empty url"):
        parse([{"type": "image_url", "image_url": {"url": ""}}])
    with pytest.raises(ValueError, match="detail must be 'auto', 'low' or 'high'"):
        parse([_image_part(_data_url(), "ultra")])
    with pytest.raises(ValueError, match="a 'text' part needs a string"):
        parse([{"type": "text"}])
    with pytest.raises(ValueError, match="content must be a string or a list"):
        parse(42)
    assert parse([{"type": "image_url", "image_url": "data:x"}]).images[0].url == "data:x"  # vLLM's short form


def test_image_pil_offline_only():
    img = Image.new("RGBA", (3, 3), (0, 0, 0, 0))
    conv = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img}, {"type": "text", "text": "?"}]}]
    parsed = parse_conversation(conv, takes_images=True, allow_pil=True)
    assert parsed.messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "?"}]
    (loaded,) = load_images(parsed.images, MediaPolicy())
    assert loaded.mode == "RGB" and loaded.getpixel((0, 0)) == (255, 255, 255)
    assert img.mode == "RGBA"  # the caller's image untouched
    with pytest.raises(ValueError, match="'image_pil' are offline only"):
        parse_conversation(conv, takes_images=True, allow_pil=False)
    with pytest.raises(ValueError, match="needs a PIL.Image"):
        parse_conversation([{"role": "user", "content": [{"type": "image_pil", "image_pil": "x"}]}],
                           takes_images=True, allow_pil=True)
    with pytest.raises(ValueError, match=r"3x3 = 9 pixels, more than the limit of 8"):
        load_images(parsed.images, MediaPolicy(max_image_pixels=8))


# ---------------------------------------------------------------- limit_mm_per_prompt


def test_limit_mm_per_prompt_parsing():
    assert parse_limit_mm_per_prompt(None) == {}
    assert parse_limit_mm_per_prompt('{"image": 4}') == {"image": 4}
    assert parse_limit_mm_per_prompt({"image": 0}) == {"image": 0}
    assert parse_limit_mm_per_prompt("image=2") == {"image": 2}
    for value, message in [('{"video": 1}', "'video'\\]: video inputs are not supported: pagedllm takes "
                                            "text and images"),
                           ({"audio": 1}, "audio inputs are not supported"),
                           ({"pictures": 1}, "unknown modality 'pictures'"),
                           ({"image": -1}, "must be an integer >= 0"),
                           ({"image": True}, "must be an integer >= 0"),
                           ("{image: 4}", "not valid JSON"),
                           ("image=four", "'four' is not an integer"),
                           ([4], "must be a dict")]:
        with pytest.raises(ValueError, match=message):
            parse_limit_mm_per_prompt(value)
    assert EngineConfig(limit_mm_per_prompt='{"image": 3}').limit_mm_per_prompt == {"image": 3}
    with pytest.raises(ValueError, match="video inputs are not supported"):
        EngineConfig(limit_mm_per_prompt={"image": 2, "video": 1})


def test_limit_mm_per_prompt_enforced():
    url = _data_url()
    conv = [{"role": "user", "content": [_image_part(url), _image_part(url)]},
            {"role": "user", "content": [_image_part(url)]}]
    assert len(parse_conversation(conv, True, {"image": 3}).images) == 3
    assert len(parse_conversation(conv, True, None).images) == 3  # default 999
    with pytest.raises(ValueError, match=r"At most 2 image\(s\) may be provided in one prompt, got 3 "
                                         r"\(limit_mm_per_prompt / --limit-mm-per-prompt\)"):
        parse_conversation(conv, True, {"image": 2})
    with pytest.raises(ValueError, match="At most 0 image"):
        check_image_count(1, {"image": 0})
    check_image_count(DEFAULT_IMAGE_LIMIT, {})
    with pytest.raises(ValueError, match="At most 999"):
        check_image_count(DEFAULT_IMAGE_LIMIT + 1, {})


# ---------------------------------------------------------------- the server's protocol


def _request(content, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": content}], **kw)


def test_request_chat_inputs():
    url = _data_url()
    req = _request([{"type": "text", "text": "Look:"}, _image_part(url, "high")])
    inputs = req.chat_inputs(takes_images=True, limits={"image": 1})
    assert inputs.messages == [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                                            {"type": "image"}]}]
    assert inputs.images[0].url == url and inputs.images[0].detail == "high"
    with pytest.raises(ValueError, match="At most 0 image"):
        req.chat_inputs(takes_images=True, limits={"image": 0})
    with pytest.raises(ValueError, match="'image_url' are not supported: m takes text only"):
        req.chat_inputs(takes_images=False, model_name="m")
    with pytest.raises(ValueError, match="'image_pil' are offline only"):  # JSON cannot carry one
        _request([{"type": "image_pil", "image_pil": "abc"}]).chat_inputs(takes_images=True)
    with pytest.raises(ValueError, match="'input_audio' are not supported: pagedllm takes text and images"):
        _request([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]).chat_inputs(True)
    # text-only conversations are unchanged for a text model
    text_req = _request([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert text_req.chat_inputs(False).messages == text_req.conversation() == [{"role": "user", "content": "a\nb"}]


def test_message_text_refuses_images_by_name():
    msg = ChatMessageParam(role="user", content=[_image_part("data:x")])
    with pytest.raises(ValueError, match="'image_url' are not supported: this endpoint takes text only"):
        msg.text()
    with pytest.raises(ValueError):
        ChatMessageParam(role="user", content=[{"type": "image_url", "image_url": {"url": "x", "detail": "max"}}])


class _TemplateTokenizer:
    """The parts of a tokenizer the chat path uses, rendering with jinja as transformers does."""

    chat_template = VLM_TEMPLATE

    def __init__(self):
        self.render_threads: list[str] = []

    def apply_chat_template(self, conversation, chat_template=None, add_generation_prompt=True, **kw):
        from jinja2 import Template

        self.render_threads.append(threading.current_thread().name)
        return Template(chat_template or self.chat_template).render(
            messages=conversation, add_generation_prompt=add_generation_prompt)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 100 for c in text]

    def __deepcopy__(self, memo):
        return self


def _chat_server(takes_images: bool, limits=None, policy=None):
    from pagedllm.engine.engine_info import EngineInfo
    from pagedllm.entrypoints.openai.chat import ChatServer
    from pagedllm.entrypoints.openai.serving import ServingContext

    got: dict = {}

    class Stop(Exception):
        pass

    async def add_request(request_id, prompt, params, **kw):
        got["prompt"] = prompt
        raise Stop

    info = EngineInfo(model_name="vlm", model_root="/x", max_model_len=4096, vocab_size=100,
                      num_blocks=64, block_size=16, chat_template=None, startup_seconds=0.0,
                      kernel_info={}, takes_images=takes_images,
                      limit_mm_per_prompt=limits or {}, media_policy=policy)
    def process_prompt(prompt):  # the engine's processor: records what it got and where it ran
        import threading

        got["processed"] = (prompt, threading.current_thread().name)
        return prompt["prompt"], [1, 2, 3], ["feature"]

    engine = SimpleNamespace(
        info=info, tokenizer=_TemplateTokenizer(), add_request=add_request,
        inputs=SimpleNamespace(scheduling_policy="fcfs", resolve_num_logprobs=lambda v, name: v,
                               process_prompt=process_prompt))
    ctx = ServingContext(engine)
    return ChatServer(ctx), got, Stop


def test_server_hands_the_engine_text_and_images():
    server, got, stop = _chat_server(True, {"image": 2})
    red, blue = _data_url((255, 0, 0)), _data_url((0, 0, 255), (8, 8))
    req = ChatCompletionRequest(messages=[
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [_image_part(red), {"type": "text", "text": "vs"}, _image_part(blue)]}],
        cache_salt="salt")
    raw = SimpleNamespace(headers={})
    try:
        with pytest.raises(stop):
            asyncio.run(server.create_chat_completion(req, raw))
        prompt = got["prompt"]
        assert prompt["prompt"] == "<|system|>sys<|user|><image>vs<image><|assistant|>"
        # processed (placeholders expanded, features made) in the tokenizer thread, then handed on
        assert prompt["prompt_token_ids"] == [1, 2, 3] and prompt["mm_features"] == ["feature"]
        assert prompt["cache_salt"] == "salt"
        processed, thread = got["processed"]
        assert thread.startswith("pagedllm-tok")
        images = processed["multi_modal_data"]["image"]
        assert [im.size for im in images] == [(6, 4), (8, 8)]
        assert [im.getpixel((0, 0)) for im in images] == [(255, 0, 0), (0, 0, 255)]
        # rendered in the tokenizer thread, never on the event loop
        assert server.ctx.tokenizer.render_threads == ["pagedllm-tok_0"]
        # a text conversation still reaches the engine as token ids
        asyncio.run(_expect(stop, server.create_chat_completion(
            ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), raw)))
        assert got["prompt"]["prompt"] == "<|user|>hi<|assistant|>"
        assert got["prompt"]["prompt_token_ids"]
    finally:
        server.ctx.close()


async def _expect(exc_type, coro):
    with pytest.raises(exc_type):
        await coro


def test_server_refusals_are_400s_before_any_fetch():
    from pagedllm.entrypoints.openai.errors import OpenAIError, as_openai_error

    raw = SimpleNamespace(headers={})
    text_server, _, _ = _chat_server(False)
    vlm_server, got, _ = _chat_server(True, {"image": 1})
    remote = "http://example.com/a.png"  # would be refused too, but the count check comes first
    cases = [
        (text_server, _request([_image_part(_data_url())]), "vlm takes text only"),
        (vlm_server, _request([_image_part(remote), _image_part(remote)]), "At most 1 image"),
        (vlm_server, _request([_image_part(remote)]), "remote images are refused.*--allowed-media-domains"),
        (vlm_server, _request([_image_part(_data_url())], truncate_prompt_tokens=5),
         "truncate_prompt_tokens is not supported with images"),
        (vlm_server, _request([{"type": "video_url", "video_url": {"url": remote}}]),
         "'video_url' are not supported: pagedllm takes text and images"),
    ]
    try:
        for server, req, message in cases:
            with pytest.raises((ValueError, OpenAIError)) as info:
                asyncio.run(server.create_chat_completion(req, raw))
            err = as_openai_error(info.value)
            assert err.status == 400, message
            assert __import__("re").search(message, err.message), (message, err.message)
        assert "prompt" not in got
    finally:
        text_server.ctx.close()
        vlm_server.ctx.close()


# ---------------------------------------------------------------- the processor's chat template


def _tiny_tokenizer_folder(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(path)
    return path


def test_processor_chat_template_files(tmp_path):
    assert processor_chat_template(tmp_path) is None
    (tmp_path / "processor_config.json").write_text(json.dumps({"chat_template": "from-processor-config"}))
    assert processor_chat_template(tmp_path) == "from-processor-config"
    (tmp_path / "chat_template.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "legacy"}]}))
    assert processor_chat_template(tmp_path) == "legacy"
    (tmp_path / "chat_template.jinja").write_text("jinja")
    assert processor_chat_template(tmp_path) == "jinja"


def test_tokenizer_without_template_gets_the_processors(tmp_path):
    from pagedllm.tokenizer import apply_chat_template, load_tokenizer

    folder = _tiny_tokenizer_folder(tmp_path / "vlm")
    assert load_tokenizer(folder).chat_template is None
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": VLM_TEMPLATE}))
    tok = load_tokenizer(folder)
    assert tok.chat_template == VLM_TEMPLATE
    parsed = parse_conversation([{"role": "user", "content": [_image_part("data:x"),
                                                              {"type": "text", "text": "hi"}]}], True)
    assert apply_chat_template(tok, parsed.messages) == "<|user|><image>hi<|assistant|>"


def test_takes_images(tmp_path):
    assert takes_images({"vision_config": {"hidden_size": 8}}) and not takes_images({"hidden_size": 8})
    assert takes_images(SimpleNamespace(vision_config=object())) and not takes_images(SimpleNamespace())
    assert not folder_takes_images(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {}}))
    assert folder_takes_images(str(tmp_path))
    assert not folder_takes_images(None)


def test_offline_chat_builds_the_prompt_dict():
    from pagedllm.llm import LLM

    tok = _TemplateTokenizer()
    llm = LLM.__new__(LLM)  # no model: the engine's parts LLM.chat reads
    llm.llm_engine = SimpleNamespace(
        config=EngineConfig(limit_mm_per_prompt={"image": 2}), model_name="vlm", pooling_inputs=None,
        generation_defaults={}, get_tokenizer=lambda: tok)
    llm._takes_images = True
    llm._media_policy = MediaPolicy()
    submitted = []
    llm._run = lambda prompts, params, use_tqdm, lora_request=None: submitted.extend(prompts) or []
    pil = Image.new("L", (5, 5), 9)
    llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": pil},
                                           {"type": "text", "text": "and"}, _image_part(_data_url())]}],
             use_tqdm=False)
    (prompt,) = submitted
    assert prompt["prompt"] == "<|user|><image>and<image><|assistant|>"
    assert [im.mode for im in prompt["multi_modal_data"]["image"]] == ["RGB", "RGB"]
    assert prompt["multi_modal_data"]["image"][0].getpixel((0, 0)) == (9, 9, 9)
    submitted.clear()
    llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)  # text: token ids as before
    assert submitted[0]["prompt"] == "<|user|>hi<|assistant|>" and submitted[0]["prompt_token_ids"]
    with pytest.raises(ValueError, match="At most 2 image"):
        llm.chat([{"role": "user", "content": [_image_part("data:x")] * 3}], use_tqdm=False)
    llm._takes_images = False
    with pytest.raises(ValueError, match="'image_pil' are not supported: vlm takes text only"):
        llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": pil}]}], use_tqdm=False)

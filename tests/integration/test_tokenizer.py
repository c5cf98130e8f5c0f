"""Tokenizer on SmolLM2's GGUF: loading + cache, chat template, incremental detokenization,
stop strings (SmolLM2 has a GPT-2 style byte-level BPE: emoji and CJK split across tokens)."""

import os
import time
from pathlib import Path

import pytest

from pagedllm.tokenizer import (
    IncrementalDetokenizer,
    apply_chat_template,
    check_stop_strings,
    convert_ids_list_to_tokens,
    load_tokenizer,
    num_held_back_chars,
)

GGUF_DIR = Path(os.environ.get("PAGEDLLM_TEST_GGUF_DIR", "~/.cache/pagedllm")).expanduser()
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (GGUF_DIR / GGUF_NAME).is_file(), reason=f"{GGUF_DIR / GGUF_NAME} not present"
)]

TEXTS = [
    "Hello, world!",
    " leading space and trailing space ",
    "  two leading spaces",
    "line one\nline two\n\n\nafter blank lines\r\nwindows",
    "Café, naïve, façade, résumé, Ångström, Øresund, Straße",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🤖",
    "Mixed: price €42, 5°C, µs, Ω, ∑x², π≈3.14159, ½ ¾",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "\tindented\twith\ttabs",
    "JSON: {\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
    "Math in Greek: αβγδε ΑΒΓΔΕ, Cyrillic: Привет мир",
    "🧑‍💻 wrote 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕥𝕖𝕩𝕥 and ﷽",
    "a" * 50 + " " + "b" * 3,
    "<html><body>Hi &amp; bye</body></html>",
    "x",
    "ends with emoji 🎉",
]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("pagedllm_cache")


@pytest.fixture(scope="module")
def load_times(cache_root):
    """Loads the GGUF tokenizer twice with an empty cache folder: converted, then cached."""
    old = os.environ.get("PAGEDLLM_CACHE_DIR")
    os.environ["PAGEDLLM_CACHE_DIR"] = str(cache_root)
    try:
        t0 = time.perf_counter()
        first = load_tokenizer(GGUF_DIR, gguf_file=GGUF_NAME)
        t1 = time.perf_counter()
        second = load_tokenizer(GGUF_DIR / GGUF_NAME)
        t2 = time.perf_counter()
    finally:
        if old is None:
            del os.environ["PAGEDLLM_CACHE_DIR"]
        else:
            os.environ["PAGEDLLM_CACHE_DIR"] = old
    print(f"\nGGUF tokenizer: converted in {t1 - t0:.2f}s, from cache in {t2 - t1:.2f}s")
    return first, second, t1 - t0, t2 - t1


@pytest.fixture(scope="module")
def tok(load_times):
    return load_times[1]


def test_gguf_tokenizer_cached(load_times, cache_root):
    first, second, t_convert, t_cached = load_times
    entries = list((cache_root / "tokenizers").iterdir())
    assert len(entries) == 1
    st = (GGUF_DIR / GGUF_NAME).stat()
    assert entries[0].name == f"{Path(GGUF_NAME).stem}-{st.st_size}-{st.st_mtime_ns}"
    assert (entries[0] / "tokenizer.json").is_file()
    assert t_cached < t_convert
    # The cached tokenizer is the same tokenizer.
    assert len(second) == len(first) == 49152
    assert second.eos_token == first.eos_token == "<|im_end|>"
    assert second.all_special_ids == first.all_special_ids
    assert second.chat_template == first.chat_template
    for text in TEXTS:
        assert second.encode(text) == first.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert apply_chat_template(second, msgs) == apply_chat_template(first, msgs)


def test_broken_cache_entry_is_rebuilt(load_times, cache_root, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(cache_root))
    entry = next((cache_root / "tokenizers").iterdir())
    (entry / "tokenizer.json").write_text("{ not json")
    tok = load_tokenizer(GGUF_DIR, gguf_file=GGUF_NAME)
    assert tok.encode("Hello, world!") == load_times[0].encode("Hello, world!")
    assert (entry / "tokenizer.json").read_text() != "{ not json"


def test_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path, gguf_file="nope.gguf")


def test_chat_template(tok):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    prompt = apply_chat_template(tok, msgs)
    assert prompt.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    no_gen = apply_chat_template(tok, msgs, add_generation_prompt=False)
    assert not no_gen.endswith("<|im_start|>assistant\n")
    assert prompt.startswith(no_gen)
    sys_msgs = [{"role": "system", "content": "Be brief."}] + msgs
    assert apply_chat_template(tok, sys_msgs).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    # The template's special tokens are real special tokens once encoded.
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    custom = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert apply_chat_template(tok, msgs, chat_template=custom) == "[user] What is 2+2?\n"


def test_chat_template_missing(cache_root, tok):
    bare = load_tokenizer(next((cache_root / "tokenizers").iterdir()))
    bare.chat_template = None
    with pytest.raises(ValueError, match="must provide a chat template"):
        apply_chat_template(bare, [{"role": "user", "content": "hi"}])
    msgs = [{"role": "user", "content": "hi"}]
    assert apply_chat_template(bare, msgs, chat_template="{{ messages[0]['content'] }}") == "hi"


def _stream(tok, prompt_ids, ids, **kw):
    detok = IncrementalDetokenizer(tok, prompt_ids, **kw)
    deltas = [detok.add_token(t) for t in ids]
    return detok, deltas


PROMPTS = [
    "",
    "Say something:",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "日本",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_incremental_equals_full_decode(tok, prompt):
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        detok, deltas = _stream(tok, prompt_ids, ids)
        full = tok.decode(ids, skip_special_tokens=True)
        assert full == text
        assert detok.text == full, text
        assert "".join(deltas) == full
        assert detok.output_token_ids == ids


def test_incremental_on_concatenated_texts(tok):
    # One long sequence: exercises the window moving far from the prompt.
    text = "\n".join(TEXTS * 3)
    ids = tok.encode(text)
    detok, deltas = _stream(tok, tok.encode("Prompt"), ids)
    assert detok.text == tok.decode(ids) == text
    assert detok.add_tokens(tok.encode(" more 🎉 text")) == " more 🎉 text"


def test_multibyte_never_emitted_half(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        _, deltas = _stream(tok, [], ids)
        for d in deltas:
            assert "\ufffd" not in d
            d.encode("utf-8")  # every delta is whole characters
    # The three tokens of an emoji: nothing until the last byte arrives.
    ids = tok.encode(" 😀")
    assert len(ids) >= 2
    _, deltas = _stream(tok, tok.encode("Hi"), ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == " 😀"


def test_incomplete_tail_is_held_back(tok):
    ids = tok.encode("ok 👍🏽")
    detok, _ = _stream(tok, [], ids[:-1])  # cut inside the skin-tone modifier
    assert detok.text == "ok 👍"
    assert tok.decode(ids[:-1]).endswith("\ufffd")
    assert detok.add_token(ids[-1]) == "🏽"
    assert detok.text == "ok 👍🏽"


def test_special_tokens(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Hello there") + [im_end] + tok.encode("\nmore")
    detok, deltas = _stream(tok, [], ids, skip_special_tokens=True)
    assert detok.text == tok.decode(ids, skip_special_tokens=True) == "Hello there\nmore"
    assert deltas[len(tok.encode("Hello there"))] == ""
    detok, deltas = _stream(tok, [], ids, skip_special_tokens=False)
    assert detok.text == tok.decode(ids, skip_special_tokens=False) == "Hello there<|im_end|>\nmore"


def test_convert_ids_list_to_tokens(tok):
    ids = tok.encode("Hi 😀")
    pieces = convert_ids_list_to_tokens(tok, ids)
    assert pieces[0] == "Hi" and len(pieces) == len(ids)
    assert all(isinstance(p, str) for p in pieces)


# ------------------------------------------------------------------------------ stop strings


def _generate_with_stop(tok, text, stop, include):
    """The engine's loop: detokenize token by token, check stop strings, stream with hold-back.
    Returns (final text, stop string, streamed text, tokens consumed)."""
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode("Q: "))
    streamed = ""
    for n, t in enumerate(ids, 1):
        delta = detok.add_token(t)
        hit = check_stop_strings(detok.text, len(delta), stop, include)
        if hit is not None:
            detok.truncate(hit[1])
            assert detok.text.startswith(streamed)  # nothing emitted is ever taken back
            return detok.text, hit[0], streamed, n
        hold = 0 if include else num_held_back_chars(detok.text, stop)
        visible = detok.text[: len(detok.text) - hold]
        assert visible.startswith(streamed)
        streamed = visible
    return detok.text, None, streamed, len(ids)


def test_stop_string_spanning_tokens(tok):
    text = "The answer is 42.\nUser: and now something else"
    stop = ["\nUser:"]
    # The stop string is not a single token: it spans several.
    assert not any("\nUser:" in tok.decode([t]) for t in tok.encode(text))
    out, stop_str, streamed, n = _generate_with_stop(tok, text, stop, include=False)
    assert (out, stop_str) == ("The answer is 42.", "\nUser:")
    assert n < len(tok.encode(text))  # stopped as soon as the stop string was complete
    out, stop_str, _, _ = _generate_with_stop(tok, text, stop, include=True)
    assert (out, stop_str) == ("The answer is 42.\nUser:", "\nUser:")


def test_stop_string_inside_a_token_cuts_what_follows(tok):
    # "Hello world" -> "Hello", " world": stop "wor" ends inside " world".
    out, stop_str, _, _ = _generate_with_stop(tok, "Hello world again", ["wor"], include=False)
    assert (out, stop_str) == ("Hello ", "wor")
    out, _, _, _ = _generate_with_stop(tok, "Hello world again", ["wor"], include=True)
    assert out == "Hello wor"


def test_stop_string_with_multibyte_chars(tok):
    text = "Start 日本語 then 🎉🎉 end"
    out, stop_str, _, _ = _generate_with_stop(tok, text, ["🎉🎉", "zzz"], include=False)
    assert (out, stop_str) == ("Start 日本語 then ", "🎉🎉")
    out, stop_str, _, _ = _generate_with_stop(tok, text, ["本語 t"], include=True)
    assert (out, stop_str) == ("Start 日本語 t", "本語 t")


def test_no_stop_streams_everything(tok):
    text = "A normal sentence, without the marker. Almost: User but no colon-newline."
    out, stop_str, streamed, _ = _generate_with_stop(tok, text, ["\nUser:"], include=False)
    assert stop_str is None and out == text
    # Hold-back only keeps a possible stop-string start: here the final "." is not one.
    assert streamed == text


def test_check_stop_strings_function():
    assert check_stop_strings("abc", 0, ["c"], False) is None
    assert check_stop_strings("abc", 1, [], False) is None
    assert check_stop_strings("hello STOP", 4, ["STOP"], False) == ("STOP", 6)
    assert check_stop_strings("hello STOP", 4, ["STOP"], True) == ("STOP", 10)
    # Spanning: only "OP" is new, the match starts in older text.
    assert check_stop_strings("hello STOP", 2, ["STOP"], False) == ("STOP", 6)
    # A match wholly inside older text is not reported again.
    assert check_stop_strings("STOP and more", 4, ["STOP"], False) is None
    # Text after the stop string in the same delta is cut.
    assert check_stop_strings("ab STOP cd", 8, ["STOP"], True) == ("STOP", 7)
    # The earliest match wins, whatever the list order.
    assert check_stop_strings("x END y STOP", 12, ["STOP", "END"], False) == ("END", 2)
    assert check_stop_strings("x ENDING", 6, ["ENDING", "END"], False) == ("ENDING", 2)


def test_num_held_back_chars():
    assert num_held_back_chars("hello", ["\nUser:"]) == 0
    assert num_held_back_chars("hello\n", ["\nUser:"]) == 1
    assert num_held_back_chars("hello\nUse", ["\nUser:"]) == 4
    assert num_held_back_chars("hello\nUser:", ["\nUser:"]) == 0  # complete: not a prefix
    assert num_held_back_chars("aab", ["ab", "aabx"]) == 3
    assert num_held_back_chars("", ["abc"]) == 0
    assert num_held_back_chars("xa", ["abc", "b"]) == 1


def _metaspace_tokenizer():
    """A SentencePiece-style fast tokenizer (Metaspace: the first token's leading space is
    dropped by a lone decode), trained here on the held-out text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")])
    text = (Path(__file__).parents[2] / "pagedllm" / "data" / "heldout.txt").read_text()
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *bytes_]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


REPLIES = [("Hello", " world, again"), ("A", "B C"), ("", "leading text"),
           ("x", " 😀 é 日本"), ("日", "本語 🇫🇷 and 👨‍👩‍👧‍👦")]


@pytest.mark.parametrize("prompt,reply", REPLIES)
def test_byte_fallback_tokenizers_keep_the_window_and_lose_no_character(prompt, reply):
    """A SentencePiece-style tokenizer (Metaspace, byte fallback: characters spelled in byte
    tokens): the Python window, since tokenizers' DecodeStream drops those characters; the
    first output token is decoded in the prompt's context (its leading space kept)."""
    fast = _metaspace_tokenizer()
    p_ids = fast.encode(prompt, add_special_tokens=False)
    out_ids = fast.encode(reply, add_special_tokens=False)
    detok = IncrementalDetokenizer(fast, p_ids)
    assert detok._stream is None
    pieces = [detok.add_token(t) for t in out_ids]
    expected = fast.decode(p_ids + out_ids)[len(fast.decode(p_ids)):]
    assert detok.text == "".join(pieces) == expected


@pytest.mark.parametrize("prompt,reply", REPLIES)
def test_byte_level_tokenizers_stream_decode_like_a_full_decode(tok, prompt, reply):
    p_ids = tok.encode(prompt, add_special_tokens=False)
    out_ids = tok.encode(reply, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, p_ids)
    assert detok._stream is not None  # SmolLM2: byte-level BPE
    pieces = [detok.add_token(t) for t in out_ids]
    assert detok.text == "".join(pieces) == tok.decode(out_ids, skip_special_tokens=True)

"""Tokenizer loading (HF folder or GGUF file), chat templates, incremental detokenization and
stop strings.

Streaming text, the engine's way (per sequence):

    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens,
                                   params.spaces_between_special_tokens)
    delta = detok.add_token(token_id)           # "" while a multi-byte character is incomplete
    if params.stop:
        hit = check_stop_strings(detok.text, len(delta), params.stop,
                                 params.include_stop_str_in_output)
        if hit is not None:                     # finish: reason "stop", stop_reason=hit[0]
            detok.truncate(hit[1])
    # While unfinished, emit only detok.text[: len(detok.text) - hold], where
    # hold = num_held_back_chars(detok.text, params.stop) if params.stop and not
    # params.include_stop_str_in_output else 0; once finished, emit all of detok.text.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedllm import envs

logger = logging.getLogger(__name__)

# Prompt tokens decoded together with the first output tokens, so that the first output
# token's leading space (SentencePiece "▁") and byte fragments come out as in a full decode.
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5


def cache_dir() -> Path:
    return envs.PAGEDLLM_CACHE_DIR


# --------------------------------------------------------------------------------- loading


def load_tokenizer(
    model_path: str | os.PathLike,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
    use_cache: bool = True,
    **kwargs: Any,
) -> PreTrainedTokenizerBase:
    """Loads a Hugging Face tokenizer from a model folder, or from a GGUF file.

    A folder whose tokenizer has no chat template gets its processor's (multimodal/model_info.py).
    GGUF: pass the folder and the file name (`gguf_file`), or the file's path as `model_path`.
    Converting a GGUF vocabulary to a fast tokenizer takes seconds, so the result is saved under
    `$PAGEDLLM_CACHE_DIR/tokenizers/` (default `~/.cache/pagedllm`), keyed by the GGUF file's
    name, size and mtime, and loaded from there the next time (`use_cache=False` skips that).
    """
    model_path = os.path.expanduser(os.fspath(model_path))
    if gguf_file is None and model_path.endswith(".gguf") and os.path.isfile(model_path):
        model_path, gguf_file = os.path.split(os.path.abspath(model_path))
    elif gguf_file is not None and os.path.dirname(gguf_file):
        model_path = os.path.join(model_path, os.path.dirname(gguf_file))
        gguf_file = os.path.basename(gguf_file)

    if gguf_file is None:
        tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code, **kwargs)
        if not getattr(tok, "chat_template", None):  # a multimodal folder: the processor's
            from pagedllm.multimodal.model_info import processor_chat_template
            tok.chat_template = processor_chat_template(model_path)
        return tok

    gguf_path = Path(model_path) / gguf_file
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if not use_cache:
        return _load_from_gguf(model_path, gguf_file, trust_remote_code, **kwargs)

    st = gguf_path.stat()
    key = f"{gguf_path.stem}-{st.st_size}-{st.st_mtime_ns}"
    cached = cache_dir() / "tokenizers" / key
    if (cached / "tokenizer_config.json").is_file():
        try:
            t0 = time.perf_counter()
            tok = AutoTokenizer.from_pretrained(
                cached, trust_remote_code=trust_remote_code, **kwargs
            )
            logger.debug("loaded cached tokenizer %s in %.2fs", cached, time.perf_counter() - t0)
            return tok
        except Exception as e:  # a broken cache entry is rebuilt, never fatal
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cached, e)
            shutil.rmtree(cached, ignore_errors=True)

    tok = _load_from_gguf(model_path, gguf_file, trust_remote_code, **kwargs)
    try:
        tmp = cached.with_name(f"{key}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(tmp)
        try:
            tmp.rename(cached)  # atomic: readers see the whole folder or none
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        logger.warning("could not cache the tokenizer in %s: %s", cached, e)
    return tok


def _load_from_gguf(
    model_path: str, gguf_file: str, trust_remote_code: bool, **kwargs: Any
) -> PreTrainedTokenizerBase:
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(
        model_path, gguf_file=gguf_file, trust_remote_code=trust_remote_code, **kwargs
    )
    logger.info("converted the tokenizer of %s in %.2fs", gguf_file, time.perf_counter() - t0)
    return tok


# ----------------------------------------------------------------------------- chat template


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Renders a conversation ([{"role": ..., "content": ...}, ...]) to a prompt string.

    The string usually starts with the template's own special tokens (BOS, <|im_start|>), so
    tokenize it with `add_special_tokens=False`, as vLLM does."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "As of transformers v4.44, default chat template is no longer allowed, so you must "
            "provide a chat template if the tokenizer does not define one."
        )
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt are not compatible. Use "
            "continue_final_message when you want the model to continue the final message, "
            "and add_generation_prompt when you want to add a header that will prompt it to "
            "start a new assistant message instead."
        )
    return tokenizer.apply_chat_template(
        conversation,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
        tokenize=False,
        **kwargs,
    )


class TemplateTimeoutError(TimeoutError):
    """A chat template's rendering ran past its time limit and was stopped."""


class _Deadline(BaseException):
    """Raised by the tracer inside the rendering; a BaseException, so that no `except
    Exception` in jinja or transformers (constant folding catches everything) swallows it."""


@contextlib.contextmanager
def render_time_limit(seconds: float) -> Iterator[None]:
    """Stop the Python code run inside the block (in this thread) once it has taken longer
    than `seconds`: a `sys.settrace` line tracer raises at the next line past the deadline,
    and the block raises TemplateTimeoutError. For request-supplied chat templates: jinja
    compiles a template to Python code, so its loops are lines the tracer sees; the tracer
    slows rendering down, so the server's own (trusted, fast) template runs without it. One
    C-level operation (a huge `str * n`) is not interrupted until it returns."""
    deadline = time.monotonic() + seconds
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        count += 1
        if count & 63 == 0 and time.monotonic() > deadline:
            raise _Deadline
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    except _Deadline:
        raise TemplateTimeoutError(
            f"The chat template took longer than {seconds:g} s to render; it was stopped."
        ) from None
    finally:
        sys.settrace(previous)


# ----------------------------------------------------------- characters a token stands for

# Input characters that at most become one character of the normalized text: NFC / NFKC
# compose a character from up to 4 code points (the longest canonical decomposition).
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}
# pre-tokenizers that keep every character (Whitespace, BertPreTokenizer... drop spaces)
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation",
                           "UnicodeScripts"}
_MAX_TOKEN_CHARS: "weakref.WeakKeyDictionary[Any, int | None]" = weakref.WeakKeyDictionary()


def _components(state: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if state is None:
        return []
    if state.get("type") == "Sequence":
        return [c for sub in state.get(key, []) for c in _components(sub, key)]
    return [state]


def _state(component: Any) -> dict[str, Any] | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> int | None:
    """How many input characters one normalized character may come from, or None when the
    normalizer may drop characters (Strip, StripAccents, BertNormalizer, Precompiled...)."""
    factor = 1
    for n in _components(normalizer, "normalizers"):
        kind = n.get("type")
        if kind == "Replace":
            pattern, content = n.get("pattern", {}).get("String"), n.get("content", "")
            if not pattern or not content:
                return None  # a regex, or replaced by nothing
            factor *= max(1, -(-len(pattern) // len(content)))
        elif kind in _NORMALIZER_SHRINK:
            factor *= _NORMALIZER_SHRINK[kind]
        else:
            return None
    return factor


def _compute_max_token_chars(tokenizer: Any) -> int | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if model is None or type(model).__name__ != "BPE":
        return None  # WordPiece / Unigram / slow tokenizers: an unknown token may fuse text
    pre = _components(_state(backend.pre_tokenizer), "pretokenizers")
    if any(p.get("type") not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed"
           for p in pre):
        return None
    byte_level = any(p.get("type") == "ByteLevel" for p in pre)
    if not (byte_level or getattr(model, "byte_fallback", False)):
        return None  # a character outside the vocabulary may be dropped or fused into <unk>
    if any(t.lstrip or t.rstrip for t in tokenizer.added_tokens_decoder.values()):
        return None  # such an added token swallows any run of spaces next to it
    shrink = _normalizer_shrink(_state(backend.normalizer))
    if shrink is None:
        return None
    # a byte-level piece's length is its bytes (each stands for one), an upper bound on its
    # characters; a Metaspace piece's is its characters ("▁" for a space); added tokens match
    # their content
    longest = max((len(piece) for piece in tokenizer.get_vocab()), default=0)
    return longest * shrink if longest else None


def max_chars_per_token(tokenizer: Any) -> int | None:
    """An upper bound on how many prompt characters one token can stand for, or None when this
    tokenizer has none (it may drop characters: whitespace splitting, a fused <unk>, a
    stripping normalizer). Read once per tokenizer from its vocabulary and pipeline."""
    try:
        return _MAX_TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        value = _compute_max_token_chars(tokenizer)
    except (AttributeError, TypeError, ValueError):  # not a transformers fast tokenizer
        value = None
    try:
        _MAX_TOKEN_CHARS[tokenizer] = value
    except TypeError:  # not weak-referenceable: not cached
        pass
    return value


def convert_ids_list_to_tokens(
    tokenizer: PreTrainedTokenizerBase, token_ids: Iterable[int]
) -> list[str]:
    """Each token's own text (for `Logprob.decoded_token`), as vLLM: `decode([token_id])`."""
    return [tokenizer.decode([t]) or "" for t in token_ids]


# ------------------------------------------------------------------- incremental detokenizer

# The special token ids of each tokenizer, read once: transformers rebuilds `all_special_ids`
# (a property walking the special-token map) on every `convert_ids_to_tokens(...,
# skip_special_tokens=True)` call, which was 1.5 ms of a batch-256 step (one call per token).
# Like vLLM's cached tokenizer, tokens added after the first use are not seen here.
_SPECIAL_IDS: "weakref.WeakKeyDictionary[PreTrainedTokenizerBase, frozenset[int]]" = (
    weakref.WeakKeyDictionary()
)


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = _SPECIAL_IDS.get(tokenizer)
    if ids is None:
        ids = _SPECIAL_IDS[tokenizer] = frozenset(tokenizer.all_special_ids)
    return ids


def _convert_tokens_to_string_with_added_encoders(
    tokenizer: PreTrainedTokenizerBase,
    output_tokens: list[str],
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> str:
    # Slow tokenizers decode added tokens separately (vLLM / HF's slow decode).
    sub_texts: list[str] = []
    current: list[str] = []
    all_special = set(tokenizer.all_special_tokens)
    added_vocab = tokenizer.get_added_vocab()
    for token in output_tokens:
        if skip_special_tokens and token in all_special:
            continue
        if token in added_vocab:
            if current:
                sub_texts.append(tokenizer.convert_tokens_to_string(current))
                current = []
            sub_texts.append(token)
        else:
            current.append(token)
    if current:
        sub_texts.append(tokenizer.convert_tokens_to_string(current))
    return (" " if spaces_between_special_tokens else "").join(sub_texts)


def decode_stream_backend(tokenizer) -> Any | None:
    """The `tokenizers.Tokenizer` to stream-decode with, or None (slow tokenizer, or a decoder
    with byte fallback). Decided once per tokenizer (the check serializes it: 42 ms for
    SmolLM2's); `OutputProcessor` asks at start-up, not at a request's first token."""
    cached = getattr(tokenizer, "_pagedllm_decode_stream", False)
    if cached is not False:
        return cached
    backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        try:
            decoder = json.loads(backend.to_str()).get("decoder")
        except Exception:
            decoder = None
        if decoder is None or "ByteFallback" in json.dumps(decoder):
            backend = None
    try:
        tokenizer._pagedllm_decode_stream = backend
    except Exception:
        pass
    return backend


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text a token at a time.

    vLLM's / TGI's scheme: keep the token strings; decode only the window
    `tokens[prefix_offset:]` and subtract the text of `tokens[prefix_offset:read_offset]` (what
    was already emitted at the window's start). New text is held back while it ends with
    U+FFFD (an incomplete UTF-8 sequence, e.g. half an emoji); the window then grows until the
    character is complete. The window starts on the prompt's last tokens, so that the first
    output token is decoded in context.

    At the end, `text == tokenizer.decode(output_ids, skip_special_tokens=...)` for any output
    that does not end in the middle of a character (an incomplete tail is never emitted).

    A fast tokenizer whose decoder has no byte fallback (byte-level BPE: GPT-2, Llama 3, Qwen,
    SmolLM2) decodes with `tokenizers`' own `DecodeStream` instead, the same scheme in Rust with
    the same prompt context: 0.7 against 3.0 us a token on SmolLM2. Byte-fallback decoders
    (SentencePiece-style: Llama 2, Mistral, Gemma) keep the window above: tokenizers 0.23.3's
    `DecodeStream` drops a character spelled in byte tokens (`<0xF0><0x9F><0x98><0x80>` never
    comes out; tests/integration/test_tokenizer.py), and so do slow tokenizers.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._plain = tokenizer.is_fast or not tokenizer.get_added_vocab()
        self._skipped_ids = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        self.output_token_ids: list[int] = []
        self.text = ""
        n = INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
        tail = list(prompt_token_ids[-n - 2 :])
        backend = decode_stream_backend(tokenizer)
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(ids=tail, skip_special_tokens=skip_special_tokens)
            return
        self._tokens: list[str] = self._to_tokens(tail)
        self.read_offset = len(self._tokens)
        self.prefix_offset = max(self.read_offset - n, 0)

    def _to_tokens(self, ids: list[int]) -> list[str]:
        if not ids:
            return []
        toks = self.tokenizer.convert_ids_to_tokens(
            ids, skip_special_tokens=self.skip_special_tokens
        )
        if isinstance(toks, str):
            toks = [toks]
        return [t if t is not None else "" for t in toks]

    def _to_string(self, tokens: list[str]) -> str:
        if not tokens:
            return ""
        if self._plain:
            return self.tokenizer.convert_tokens_to_string(tokens)
        return _convert_tokens_to_string_with_added_encoders(
            self.tokenizer, tokens, self.skip_special_tokens, self.spaces_between_special_tokens
        )

    def add_token(self, token_id: int) -> str:
        """Appends one token; returns the text it completes ("" if none yet)."""
        self.output_token_ids.append(token_id)
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id) or ""
            self.text += delta
            return delta
        if token_id in self._skipped_ids:  # a skipped special token
            return ""
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        self._tokens.append(token if token is not None else "")
        prefix_text = self._to_string(self._tokens[self.prefix_offset : self.read_offset])
        new_text = self._to_string(self._tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new, or an incomplete character: wait for more bytes
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._tokens)
        if self.prefix_offset > 64:  # drop token strings that no window will read again
            del self._tokens[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        self.text += delta
        return delta

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add_token(t) for t in token_ids)

    def truncate(self, length: int) -> None:
        """Cuts the text (after a stop string matched; no more tokens are added then)."""
        self.text = self.text[:length]


# ------------------------------------------------------------------------------ stop strings


def check_stop_strings(
    text: str, new_char_count: int, stop: Sequence[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Finds a stop string that ends within the last `new_char_count` characters of `text`
    (it may start in older text: stop strings span token boundaries).

    Returns `(stop_str, truncate_to)`: the output text is `text[:truncate_to]`, which ends just
    before the stop string, or just after it with include_stop_str_in_output. If several stop
    strings occur, the one that starts first wins (then the first listed). None if no match.
    """
    if not new_char_count or not stop:
        return None
    best: tuple[int, str] | None = None
    for stop_str in stop:
        # Only text that could contain a match ending in the new characters is searched.
        start = max(len(text) - new_char_count - len(stop_str) + 1, 0)
        idx = text.find(stop_str, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop_str)
    if best is None:
        return None
    idx, stop_str = best
    return stop_str, idx + len(stop_str) if include_stop_str_in_output else idx


def num_held_back_chars(text: str, stop: Sequence[str]) -> int:
    """How many characters at the end of `text` a stream must not emit yet: the longest suffix
    of `text` that is the beginning of a stop string (it may still become one). At most
    `max(len(s) for s in stop) - 1`, vLLM's fixed hold-back (`output_text_buffer_length`)."""
    held = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held

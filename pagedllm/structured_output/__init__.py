"""Structured outputs and token masks: grammars compiled by xgrammar, one matcher per sequence,
one packed bitmask per step for the batch's constrained rows.

Three constraints share one mechanism, a packed int32 bitmask row per sampling row (bit t of a
row set = token t allowed), applied to the logits by the sampler in one batched op
(`layers/sampling_masks.apply_token_bitmask`):

* `structured_outputs` (json / regex / choice / grammar / json_object / structural_tag): the
  request's grammar is compiled once (xgrammar's `GrammarCompiler`, whose cache makes equal
  constraints compile once per engine); each sequence has its own `GrammarMatcher`, advanced by
  every accepted token; the matcher fills the sequence's row each step.
* `allowed_token_ids`: a fixed row per request, ANDed in.
* `bad_words`: tokenized once per request (vLLM's rule: the word and its space-prefixed form);
  each step the last token of every word whose other tokens were just generated is cleared.

Only grammars need xgrammar (`pip install pagedllm[structured]`); it is imported lazily. The
core builds the masks before it calls the model runner (they depend only on tokens already
accepted), on a worker thread, so they are filled while the forward runs.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_outputs_params import StructuredOutputsParams
from pagedllm.structured_output.compiler_process import DEFAULT_TIMEOUT_S, CompilerProcess

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

_XGR_LOCATION = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*")


def _xgrammar():
    try:
        # lazy: xgrammar is optional (pagedllm[structured]) and slow to import (2 s)
        import xgrammar
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError(
            "structured_outputs needs xgrammar, which is not installed: "
            "pip install 'pagedllm[structured]'"
        ) from exc
    return xgrammar


def _clean(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip()
    return _XGR_LOCATION.sub("", text.splitlines()[0] if text else type(exc).__name__)


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose language is exactly `choices` (JSON string escapes are GBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _json_schema(so: StructuredOutputsParams) -> str:
    if so.json_object:
        return '{"type": "object"}'
    schema = so.json
    return schema if isinstance(schema, str) else json.dumps(schema)


def _structural_tag(so: StructuredOutputsParams) -> str:
    tag = so.structural_tag
    return tag if isinstance(tag, str) else json.dumps(tag)


def _compile_key(so: StructuredOutputsParams) -> tuple[str, str, bool]:
    """(compiler kind, text, any_whitespace): what the compiler process compiles; equal
    constraints have equal keys (choice and json_object become a grammar and a schema)."""
    kind = so.kind
    any_ws = not so.disable_any_whitespace
    if kind in ("json", "json_object"):
        return "json", _json_schema(so), any_ws
    if kind == "regex":
        return "regex", so.regex, any_ws
    if kind == "choice":
        return "grammar", choice_grammar(so.choice), any_ws
    if kind == "grammar":
        return "grammar", so.grammar, any_ws
    return "structural_tag", _structural_tag(so), any_ws


def check_constraint(so: StructuredOutputsParams) -> None:
    """Parse the constraint without a tokenizer (cheap; the front end's check): a ValueError
    naming the constraint and xgrammar's reason when it is invalid."""
    xgr = _xgrammar()
    kind = so.kind
    try:
        if kind in ("json", "json_object"):
            xgr.Grammar.from_json_schema(_json_schema(so), any_whitespace=not so.disable_any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(so.regex)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(so.choice))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(so.grammar)
        else:
            xgr.Grammar.from_structural_tag(_structural_tag(so))
    except RecursionError:  # json.dumps of a deep dict (before RuntimeError: a subclass)
        raise ValueError(f"Invalid structured_outputs.{kind}: it is nested too deeply.") from None
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"Invalid structured_outputs.{kind}: {_clean(exc)}") from None


@dataclass
class RequestConstraint:
    """What a request's sequences are masked by; shared by its n samples."""

    grammar: Any = None  # xgrammar.CompiledGrammar
    allowed_row: torch.Tensor | None = None  # [W] int32, the allowed_token_ids bits
    bad_words_ids: list[list[int]] = field(default_factory=list)

    def new_matcher(self) -> "xgrammar.GrammarMatcher | None":
        if self.grammar is None:
            return None
        return _xgrammar().GrammarMatcher(self.grammar)


class StructuredOutputManager:
    """Per engine core: the per-request constraints, and the grammar compiler process
    (structured_output/compiler_process.py: the tokenizer's xgrammar vocabulary is built and
    grammars are compiled off the busy loop, each within `compile_timeout_s`)."""

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: Sequence[int],
        compile_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size  # the model's (padded) vocabulary: the logits' width
        self.bitmask_width = (vocab_size + 31) // 32
        self.stop_token_ids = sorted(stop_token_ids)
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._compiler = CompilerProcess(self._tokenizer_info, compile_timeout_s)
        self._pool: ThreadPoolExecutor | None = None

    @property
    def tokenizer(self):
        with self._tokenizer_lock:  # the compiler's service thread may load it first
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
            return self._tokenizer

    def _tokenizer_info(self) -> "xgrammar.TokenizerInfo":
        return _xgrammar().TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size,
            stop_token_ids=self.stop_token_ids or None,
        )

    # ---- per request ----------------------------------------------------------------------

    def submit_compile(self, params: SamplingParams) -> "Future[Any] | None":
        """Start compiling the request's grammar (None: it has none). The future's result is
        the compiled grammar; its exception a ValueError (the client's 400) for a constraint
        that does not compile or takes too long. Never blocks."""
        so = params.structured_outputs
        if so is None:
            return None
        _xgrammar()  # not installed: a ValueError now, naming the extra
        compiled = self._compiler.submit(_compile_key(so))
        if compiled.done() and compiled.exception() is None:
            return compiled
        out: Future = Future()

        def done(f: Future) -> None:
            exc = f.exception()
            if exc is None:
                out.set_result(f.result())
            elif isinstance(exc, ValueError):
                out.set_exception(ValueError(f"Invalid structured_outputs.{so.kind}: "
                                             f"{_clean(exc)}"))
            else:
                out.set_exception(exc)

        compiled.add_done_callback(done)
        return out

    def constraint_for(self, params: SamplingParams,
                       grammar: Any = None) -> RequestConstraint | None:
        """The request's constraint, or None when it has none. `grammar`: its compiled grammar
        when the caller compiled it already (`submit_compile`); else it is compiled here,
        blocking. Raises ValueError (the client's 400) for a constraint that does not compile;
        nothing is kept then."""
        so = params.structured_outputs
        if so is None and not params.allowed_token_ids and not params.bad_words:
            return None
        out = RequestConstraint()
        if so is not None:
            out.grammar = grammar if grammar is not None else self.compile(so)
        if params.allowed_token_ids:
            out.allowed_row = pack_token_ids(params.allowed_token_ids, self.vocab_size)
        if params.bad_words:
            out.bad_words_ids = self.bad_words_token_ids(params.bad_words)
        return out

    def compile(self, so: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        """Compile, blocking (the time limit holds)."""
        _xgrammar()
        try:
            return self._compiler.compile(_compile_key(so))
        except ValueError as exc:
            raise ValueError(f"Invalid structured_outputs.{so.kind}: {_clean(exc)}") from None

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each word's token ids, and those of its space-prefixed form where that is a different
        word token of the same length (vLLM's rule: a word is banned at the start of the text
        and after a space)."""
        tok = self.tokenizer
        out: list[list[int]] = []
        for word in words:
            bare = tok.encode(word.lstrip(), add_special_tokens=False)
            spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
            for ids in (bare, spaced):
                if ids and ids not in out and (ids is bare or (
                        ids[0] != bare[0] and len(ids) == len(bare))):
                    out.append(list(ids))
        bad = sorted({t for ids in out for t in ids if not 0 <= t < self.vocab_size})
        if bad:
            raise ValueError(f"bad_words tokenize to out-of-vocabulary ids {bad}.")
        return out

    # ---- per step -------------------------------------------------------------------------

    def submit_masks(self, entries: list[tuple[int, RequestConstraint, Any, Sequence[int]]]
                     ) -> "Future[dict[int, torch.Tensor]] | None":
        """Fill the bitmask rows of `entries` ((key, constraint, matcher, output token ids))
        on the worker thread; the result maps key -> its [W] int32 row. None: no entries."""
        if not entries:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-masks")
        return self._pool.submit(self.build_masks, entries)

    def build_masks(self, entries: list[tuple]) -> dict[Any, torch.Tensor]:
        """The rows of `entries`: (key, constraint, matcher, output ids[, draft tokens]). An
        entry with k drafts (speculative decoding) gets k + 1 rows, keyed (key, j): the mask
        after its output and its first j drafts (the matcher steps through them, then is
        rolled back)."""
        num_rows = sum(1 + len(e[4]) if len(e) > 4 else 1 for e in entries)
        bitmask = torch.full((num_rows, self.bitmask_width), -1, dtype=torch.int32)
        keys: list[Any] = []
        for key, constraint, matcher, output_ids, *rest in entries:
            drafts = list(rest[0]) if rest else []
            if not drafts:
                self._fill_row(bitmask, len(keys), constraint, matcher, output_ids)
                keys.append(key)
                continue
            history = list(output_ids)
            for j in range(len(drafts) + 1):
                self._fill_row(bitmask, len(keys), constraint, matcher, history)
                keys.append((key, j))
                if j == len(drafts):
                    break
                if matcher is not None and not matcher.accept_token(drafts[j]):
                    raise RuntimeError(f"draft token {drafts[j]} passed the grammar at proposal time, not now")
                history.append(drafts[j])
            if matcher is not None:
                matcher.rollback(len(drafts))
        return {key: bitmask[i] for i, key in enumerate(keys)}

    @staticmethod
    def _fill_row(bitmask: torch.Tensor, i: int, constraint: RequestConstraint, matcher: Any,
                  output_ids: Sequence[int]) -> None:
        if matcher is not None and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, i)
        if constraint.allowed_row is not None:
            bitmask[i] &= constraint.allowed_row
        if constraint.bad_words_ids:
            clear_token_bits(bitmask[i], banned_tokens(constraint.bad_words_ids, output_ids))

    def valid_draft_prefix(self, constraint: RequestConstraint, matcher: Any, output_ids: Sequence[int],
                           drafts: Sequence[int]) -> int:
        """How many leading drafts the constraint allows after `output_ids` (the grammar
        accepts them in order; allowed_token_ids and bad_words permit them): a draft the
        grammar refuses ends the proposal. The matcher is left as it was."""
        n = 0
        history = list(output_ids)
        for token in drafts:
            if constraint.allowed_row is not None and not token_allowed(constraint.allowed_row, token):
                break
            if constraint.bad_words_ids and token in banned_tokens(constraint.bad_words_ids, history):
                break
            if matcher is not None and (matcher.is_terminated() or not matcher.accept_token(token)):
                break
            history.append(token)
            n += 1
        if matcher is not None and n:
            matcher.rollback(n)
        return n

    def shutdown(self) -> None:
        self._compiler.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def banned_tokens(bad_words_ids: list[list[int]], output_ids: Sequence[int]) -> list[int]:
    """The tokens that would complete a bad word now: a one-token word always, a longer one
    when its other tokens end the output."""
    banned = []
    n = len(output_ids)
    for ids in bad_words_ids:
        k = len(ids) - 1
        if k == 0 or (n >= k and list(output_ids[n - k:]) == ids[:-1]):
            banned.append(ids[-1])
    return banned


def pack_token_ids(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """A [ceil(V/32)] int32 bitmask row with exactly `token_ids` set."""
    width = (vocab_size + 31) // 32
    bits = torch.zeros(width * 32, dtype=torch.bool)
    bits[torch.as_tensor(list(token_ids), dtype=torch.int64)] = True
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64), torch.arange(32))
    packed = (bits.view(width, 32).to(torch.int64) * weights).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def token_allowed(row: torch.Tensor, token: int) -> bool:
    """Whether `token`'s bit is set in a packed int32 row."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def clear_token_bits(row: torch.Tensor, token_ids: Sequence[int]) -> None:
    """Clear the bits of `token_ids` in a packed int32 row (in place)."""
    for t in set(token_ids):
        bit = 1 << (t & 31)
        mask = ~bit if bit < 2**31 else 2**31 - 1  # int32: ~(1 << 31) is 0x7fffffff
        row[t >> 5] &= mask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] packed int32 -> [R, vocab_size] bool (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = torch.bitwise_and(torch.bitwise_right_shift(bitmask.unsqueeze(-1), shifts), 1)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()

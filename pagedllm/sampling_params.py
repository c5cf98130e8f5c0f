"""Sampling parameters for text generation, mirroring vLLM's `SamplingParams`.

Everything is validated once, at construction, with a `ValueError` whose message names the
field, the allowed range and the value received (vLLM's wording). Normalisations done there:
`stop` (str or list) becomes a list, `stop_token_ids` a list, `top_k=-1` becomes 0 (off),
`seed=-1` becomes None, `logprobs=True` becomes 1, temperatures in [1e-5, 1e-2) are raised to
1e-2, and greedy sampling (temperature < 1e-5) resets top_p/top_k/min_p to "off".

This module imports no torch.
"""

from __future__ import annotations

import copy
import enum
import logging
from dataclasses import dataclass, field
from typing import Any

from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.structured_outputs_params import StructuredOutputsParams
from pagedllm.value_checks import as_float, check_int, check_length_penalty, is_int

# Public API: `from pagedllm.sampling_params import SamplingParams, BeamSearchParams` (vLLM's
# module layout); StructuredOutputsParams travels in SamplingParams.structured_outputs.
__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams", "SamplingType",
           "StructuredOutputsParams"]

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5  # temperature below this means greedy
_MAX_TEMP = 1e-2  # smallest non-zero temperature used (avoids inf/nan in logits / T)
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1  # vLLM's bounds: torch.long
# OpenAI's documented range for a logit bias; vLLM clamps to it (a larger one gives inf/nan)
_LOGIT_BIAS_MAX = 100.0
# The server's bound too (entrypoints/openai/sampling_request.py); larger is "all" anyway.
_TOP_K_MAX = 2**31 - 1


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.Enum):
    # Return the entire output so far in every RequestOutput.
    CUMULATIVE = 0
    # Return only what is new since the previous RequestOutput.
    DELTA = 1
    # Return nothing until the request has finished.
    FINAL_ONLY = 2



@dataclass
class SamplingParams:
    """Sampling parameters for one request (OpenAI completion semantics, vLLM names).

    Args:
        n: number of output sequences returned for the prompt.
        best_of: accepted for compatibility; must be None or at least `n`. The engine returns
            `n` sequences (no best-of ranking).
        presence_penalty: subtracted from the logit of every token that already appears in the
            generated output. In [-2, 2].
        frequency_penalty: subtracted once per occurrence of the token in the generated output.
            In [-2, 2].
        repetition_penalty: for tokens in the prompt or the output, positive logits are divided
            by it and negative logits multiplied by it (CTRL / HF). > 0; 1 = off.
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: nucleus sampling, in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 (or -1) = off.
        min_p: drop tokens whose probability is below min_p × the top probability; 0 = off.
        seed: per-request seed; the sampled tokens then depend only on it and the logits.
            A 64-bit integer, in [-2**63, 2**63 - 1]; -1 = none.
        stop: strings that stop generation; not included in the output text unless
            `include_stop_str_in_output`.
        stop_token_ids: token ids that stop generation (the token stays in `token_ids`).
        ignore_eos: keep generating after EOS.
        max_tokens: most tokens to generate; None = up to the model's context length.
        min_tokens: EOS and stop_token_ids are blocked until this many tokens are generated.
        logprobs: number of top log-probabilities returned per generated token (plus the sampled
            token's own). None = none; -1 = the whole vocabulary (up to --max-logprobs).
        prompt_logprobs: the same for each prompt token.
        detokenize: produce output text (needed for stop strings).
        skip_special_tokens / spaces_between_special_tokens: detokenization options.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        logit_bias: token id -> value added to its logit before sampling, clamped to
            [-100, 100] (OpenAI's range; vLLM clamps too).
        output_kind: CUMULATIVE, DELTA or FINAL_ONLY RequestOutputs while streaming.
        use_beam_search: run beam search with beam width `n` (greedy; no sampling knobs).
        length_penalty: beam scores are divided by length ** length_penalty; in [-50, 50].
        structured_outputs: a grammar constraint on the output (StructuredOutputsParams, or a
            dict of its fields); not with beam search.
        allowed_token_ids: only these token ids may be sampled.
        bad_words: words that are never generated (vLLM's rule: a word's last token is banned
            where the tokens before it were just generated; single-token words always).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Beam search through the sampling API (vLLM's server extra): beam width = n.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    # Set in __post_init__, not inputs.
    # Characters of output text to hold back while streaming, so that no text is emitted that
    # may turn out to be the start of a stop string (vLLM's fixed rule; see also
    # tokenizer.num_held_back_chars for the minimal amount).
    output_text_buffer_length: int = field(default=0, init=False, repr=False)
    # stop_token_ids + EOS ids added by the engine (update_from_generation_config); the set
    # that min_tokens blocks.
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        # --- types and normalisation -------------------------------------------------
        check_int("n", self.n)
        check_int("best_of", self.best_of, allow_none=True)
        self.presence_penalty = as_float("presence_penalty", self.presence_penalty)
        self.frequency_penalty = as_float("frequency_penalty", self.frequency_penalty)
        self.repetition_penalty = as_float("repetition_penalty", self.repetition_penalty)
        self.temperature = as_float("temperature", self.temperature)
        self.top_p = as_float("top_p", self.top_p)
        check_int("top_k", self.top_k)
        self.min_p = as_float("min_p", self.min_p)
        self.length_penalty = as_float("length_penalty", self.length_penalty)
        check_length_penalty(self.length_penalty)
        check_int("seed", self.seed, allow_none=True)
        check_int("max_tokens", self.max_tokens, allow_none=True)
        check_int("min_tokens", self.min_tokens)
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        check_int("logprobs", self.logprobs, allow_none=True)
        check_int("prompt_logprobs", self.prompt_logprobs, allow_none=True)
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
            "use_beam_search",
        ):
            if not isinstance(getattr(self, name), bool):
                value = getattr(self, name)
                raise ValueError(f"{name} must be a bool, got {type(value).__name__}: {value!r}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(
                f"output_kind must be a RequestOutputKind, got {self.output_kind!r}."
            )

        # vLLM clamps every 0 < T < 1e-2; here T < 1e-5 stays greedy (as its sampling_type
        # says) and only 1e-5 <= T < 1e-2 is raised.
        if _SAMPLING_EPS <= self.temperature < _MAX_TEMP:
            logger.warning(
                "temperature %s is less than %s, which may cause numerical errors nan or inf "
                "in tensors. We have maxed it out to %s.",
                self.temperature,
                _MAX_TEMP,
                _MAX_TEMP,
            )
            self.temperature = _MAX_TEMP

        if self.seed == -1:
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0  # -1 is accepted as "off", 0 is the canonical spelling

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
            if not all(isinstance(s, str) for s in self.stop):
                raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple, set)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}."
            )

        if self.logit_bias is not None:
            self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        self._normalize_token_constraints()

        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1

        self._verify_args()

        if self.temperature < _SAMPLING_EPS:
            # Zero temperature means greedy sampling: the filters cannot change the argmax.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            # n > 1 with greedy is allowed (as in vLLM v1): the samples are equal, and they
            # share every block, which is what the sharing tests use.

        # The engine adds the EOS id(s) (update_from_generation_config).
        self._all_stop_token_ids = set(self.stop_token_ids)

    @staticmethod
    def _normalize_logit_bias(logit_bias: Any) -> dict[int, float]:
        if not isinstance(logit_bias, dict):
            raise ValueError(
                f"logit_bias must be a dict of token id to bias, got {type(logit_bias).__name__}."
            )
        out: dict[int, float] = {}
        for token, bias in logit_bias.items():
            # OpenAI clients send the token ids as JSON object keys, i.e. strings.
            if is_int(token):
                token_id = int(token)
            elif isinstance(token, str) and token.strip().lstrip("-").isdigit():
                token_id = int(token)
            else:
                raise ValueError(f"logit_bias keys must be token ids (int), got {token!r}.")
            if token_id < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token_id}.")
            value = as_float(f"logit_bias[{token_id}]", bias)
            out[token_id] = min(max(value, -_LOGIT_BIAS_MAX), _LOGIT_BIAS_MAX)
        return out

    def _normalize_token_constraints(self) -> None:
        """structured_outputs (a dict is accepted), allowed_token_ids and bad_words."""
        so = self.structured_outputs
        if isinstance(so, dict):
            self.structured_outputs = so = StructuredOutputsParams.from_dict(so)
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}."
            )
        if so is not None and self.use_beam_search:
            raise ValueError(
                "structured_outputs is not supported with beam search (use_beam_search=True): "
                "use sampling or greedy decoding."
            )
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple, set)) or not all(is_int(t) for t in ids):
                raise ValueError(f"allowed_token_ids must be a list of token ids, got {ids!r}.")
            if not ids:
                raise ValueError("allowed_token_ids is not None and empty!")
            if any(t < 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be non-negative, got {sorted(ids)}.")
            self.allowed_token_ids = sorted(set(int(t) for t in ids))
        if self.bad_words is not None:
            words = self.bad_words
            if isinstance(words, str):
                words = [words]
            if not isinstance(words, (list, tuple)) or not all(
                isinstance(w, str) and w.strip() for w in words
            ):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {words!r}.")
            self.bad_words = list(words) or None
        if self.use_beam_search and (self.allowed_token_ids or self.bad_words):
            raise ValueError("allowed_token_ids and bad_words are not supported with beam search.")

    def verify(self) -> None:
        """Check every rule again (after the engine filled a default such as `max_tokens`):
        what decoding the request in the core would check."""
        self._verify_args()

    def _verify_args(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(
                f"best_of must be greater than or equal to n, got n={self.n} and "
                f"best_of={self.best_of}."
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}."
            )
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.top_k > _TOP_K_MAX:
            raise ValueError(f"top_k must be at most {_TOP_K_MAX} (a 32-bit integer), got "
                             f"{self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        # -1: the whole vocabulary (vLLM); the engine resolves it (InputProcessor.validate)
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ValueError(
                f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs}.")
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise ValueError(
                f"seed must be in [{_SEED_MIN}, {_SEED_MAX}] (a 64-bit integer), got {self.seed}.")
        if not all(is_int(t) for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must contain only integers, got {self.stop_token_ids}."
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids}."
            )
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are only supported when detokenize is True. "
                "Set detokenize=True to use stop."
            )

    def verify_token_ids(self, vocab_size: int) -> None:
        """Checks token ids against the model's vocabulary (the engine calls this at
        add_request, where the vocabulary size is known)."""
        if self.logit_bias:
            invalid = sorted(t for t in self.logit_bias if t >= vocab_size)
            if invalid:
                raise ValueError(
                    f"token_id(s) {invalid} in logit_bias contain out-of-vocab token ids. "
                    f"Vocabulary size: {vocab_size}"
                )
        if self.allowed_token_ids:
            invalid = [t for t in self.allowed_token_ids if t >= vocab_size]
            if invalid:
                raise ValueError(
                    f"allowed_token_ids {invalid} are out of vocabulary (size {vocab_size})."
                )
        # A constraint's syntax is checked where it is compiled, in the core's grammar
        # compiler process, within a time limit (a bad one is the client's 400 from there):
        # parsing it here would run on the server's event loop (0.65 s for a 100,000-item
        # enum), where every stream waits.

    def update_from_generation_config(
        self, generation_config: dict[str, Any], model_eos_token_id: int | None = None
    ) -> None:
        """Adds the model's EOS id(s) to the ids that min_tokens blocks, and (unless ignore_eos)
        turns the extra EOS ids of generation_config into stop_token_ids, as vLLM does."""
        if model_eos_token_id is not None:
            self._all_stop_token_ids.add(model_eos_token_id)
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is not None:
            eos_ids = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
            eos_ids.discard(model_eos_token_id)
            if eos_ids:
                self._all_stop_token_ids.update(eos_ids)
                if not self.ignore_eos:
                    assert isinstance(self.stop_token_ids, list)
                    self.stop_token_ids = self.stop_token_ids + sorted(
                        eos_ids - set(self.stop_token_ids)
                    )

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    def clone(self) -> SamplingParams:
        """Deep copy (lists, sets and logit_bias are not shared with the original)."""
        return copy.deepcopy(self)

"""A request's input, checked before it enters the engine: prompt -> token ids, cache salt,
and the limits that would make it fail later (context length, pool size, beam width).

Rejecting here, at add_request, is what keeps a bad request from ever holding blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Iterable

from pagedllm.engine.beam_search import beam_params_from_sampling
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import max_chars_per_token

PromptType = str | list[int] | dict[str, Any]

# ----------------------------------------------------------- prompt length before tokenizing


def check_prompt_chars(text: str, max_model_len: int, chars_per_token: int | None) -> None:
    """Refuse a prompt that can never fit, without tokenizing it: more characters than
    `max_model_len` tokens of at most `chars_per_token` characters each (`max_chars_per_token`;
    None: no bound) can stand for. Tokenizing megabytes took seconds, and every request behind
    it in the tokenizer thread waited."""
    if chars_per_token is not None and len(text) > max_model_len * chars_per_token:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, the "
            f"prompt has {len(text)} characters, more than {max_model_len} tokens can hold "
            f"(at most {chars_per_token} characters each). Please reduce the length of the "
            "prompt."
        )


class InputProcessor:
    def __init__(
        self, tokenizer, vocab_size: int, max_model_len: int,
        check_fits: Callable[[int, int], None], max_logprobs: int = 20,
        scheduling_policy: str = "fcfs", max_num_seqs: int = 256,
    ) -> None:
        """`check_fits(num_tokens, num_lockstep_seqs)` is the scheduler's pool-size rule
        (`Scheduler.check_request_fits`): one rule for what the engine can always finish.
        `max_logprobs` is vLLM's --max-logprobs (-1: the vocabulary size); `scheduling_policy`
        decides whether a non-zero priority is allowed; `max_num_seqs` bounds `n`, `best_of`
        and the beam width (a request's samples run in one batch)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.check_fits = check_fits
        self.max_logprobs = max_logprobs
        self.scheduling_policy = scheduling_policy
        self.max_num_seqs = max_num_seqs
        # A multimodal model's processor (multimodal/processing.py); None: text only.
        self.multimodal: Any = None

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int], list[Any] | None]:
        """(prompt text, token ids, image features or None) of any prompt: a dict with
        `multi_modal_data` goes through the model's processor (its placeholders expanded)."""
        if isinstance(prompt, dict) and prompt.get("mm_features") is not None:
            # Processed already (the server's tokenizer thread, `MultiModalProcessor.process`):
            # the core checks the features again, their hashes included.
            return prompt.get("prompt"), self.check_token_ids(prompt["prompt_token_ids"]), list(prompt["mm_features"])
        if not (isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None):
            text, ids = self.tokenize(prompt)
            if self.multimodal is not None and self.multimodal.image_token_id in ids:
                raise ValueError("The prompt holds the model's image placeholder but no image: pass the images as "
                                 "multi_modal_data={'image': [...]}, one per placeholder.")
            return text, ids, None
        if self.multimodal is None:
            raise ValueError("This model takes text only: multi_modal_data (images) is not supported for it.")
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError("A prompt with multi_modal_data needs its text as 'prompt' (a string with the model's "
                             "image placeholder per image); 'prompt_token_ids' with images is not supported.")
        check_prompt_chars(text, self.max_model_len, max_chars_per_token(self.tokenizer))
        ids, features = self.multimodal.process(text, prompt["multi_modal_data"])
        return text, self.check_token_ids(ids), features or None

    @property
    def logprobs_limit(self) -> int:
        """The most logprobs per position a request may ask for."""
        return self.vocab_size if self.max_logprobs == -1 else self.max_logprobs

    def resolve_num_logprobs(self, value: int | None, name: str) -> int | None:
        """vLLM's request value -1 = the whole vocabulary; over the limit is a ValueError."""
        if value is None:
            return None
        if value == -1:
            value = self.vocab_size
        if value > self.logprobs_limit:
            raise ValueError(
                f"{name}={value}: must be less than or equal to {self.logprobs_limit} "
                f"(the engine's --max-logprobs {self.max_logprobs})."
            )
        return value

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a string, a token id list or a prompt dict. A
        string too long to ever fit is refused before it is tokenized (`check_prompt_chars`)."""
        if isinstance(prompt, str):
            check_prompt_chars(prompt, self.max_model_len, max_chars_per_token(self.tokenizer))
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("A prompt dict needs a 'prompt' or 'prompt_token_ids' key.")
        if isinstance(prompt, (list, tuple)):
            return None, self.check_token_ids(prompt)
        raise ValueError(
            f"A prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}."
        )

    @staticmethod
    def cache_salt(prompt: PromptType, cache_salt: str | None) -> str | None:
        """The request's salt: the prompt dict's `cache_salt` key wins over the argument."""
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = prompt["cache_salt"]
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}.")
        return cache_salt

    def check_token_ids(self, ids: Iterable[Any]) -> list[int]:
        ids = list(ids)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"Prompt token ids must be integers, got {t!r}.")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"Token id {t} is out of vocabulary (size {self.vocab_size}).")
        return ids

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Check the limits once the defaults are filled in; fills `params.max_tokens` when it
        is None (what is left of the context) and resolves `logprobs=-1`.

        This is the one validation, offline and in the server, and the core runs it again on
        what it decodes: a request that passes here always decodes and is accepted there."""
        n_prompt = len(prompt_ids)
        if n_prompt == 0:
            raise ValueError("The prompt is empty: at least one token is needed.")
        params.logprobs = self.resolve_num_logprobs(params.logprobs, "logprobs")
        params.prompt_logprobs = self.resolve_num_logprobs(params.prompt_logprobs,
                                                           "prompt_logprobs")
        self.check_num_samples(params)
        # Token ids inside the params (logit_bias, stop ids) must exist in this vocabulary,
        # or the sampler would fail for every request batched with this one.
        params.verify_token_ids(self.vocab_size)
        bad_stop = sorted(t for t in params.stop_token_ids if not 0 <= t < self.vocab_size)
        if bad_stop:
            raise ValueError(
                f"stop_token_ids {bad_stop} are out of vocabulary (size {self.vocab_size})."
            )
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - n_prompt
            if params.max_tokens < 1:
                raise ValueError(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, the prompt has {n_prompt} tokens, which leaves no room to generate."
                )
            params.verify()  # the rules that depend on max_tokens (min_tokens <= max_tokens)
        total = n_prompt + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {total} tokens ({n_prompt} in the messages, {params.max_tokens} "
                "in the completion). Please reduce the length of the messages or completion."
            )
        if params.use_beam_search:
            beam_params_from_sampling(params, params.max_tokens)  # rejects unsupported knobs
        self.check_fits(total, params.n if params.use_beam_search else 1)

    def check_num_samples(self, params: SamplingParams) -> None:
        """n, best_of (and the beam width, n with beam search) at most --max-num-seqs: a
        request's samples are forked at its first token and run in one batch (vLLM's bound)."""
        limit = self.max_num_seqs
        for name, value in (("best_of", params.best_of), ("n", params.n)):
            if value is not None and value > limit:
                raise ValueError(
                    f"{name}={value}: must be less than or equal to {limit} (the engine's "
                    f"--max-num-seqs: a request's samples run in one batch)."
                )

"""PoolingInputs: the request rule of a pooling model, without the model: what the model
is (encoder / decoder / cross-encoder, its tasks, its maximum length, its pooling
configuration) and how a prompt becomes token ids (the model's special tokens, the
sentence-transformers prompt, truncation, the limits). The front ends (the offline `LLM`, the
server's `AsyncLLMEngine`) tokenize with it; the engine core reads the model's description
from it (engine/core_pooling.py) and loads no tokenizer."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_config import check_request_fits_pool
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.pooler_config import PoolerConfig, load_pooler_config
from pagedllm.pooling.poolers import check_dimensions, embedding_dimensions
from pagedllm.pooling.work import PoolingWork

if TYPE_CHECKING:
    from pagedllm.model.resolution import ModelResolution

# what a prompt may be: text, a {"prompt_token_ids": [...]} dict, or a (text, text_pair) for cross-encoders
PoolingPrompt = Any


class PromptError(ValueError):
    """A prompt of a batch that cannot run; `index` says which."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


class PoolingInputs:
    """The model's description and `prepare_many` / `prepare`: validated, tokenized work."""

    def __init__(self, config: EngineConfig, resolution: ModelResolution | None = None,
                 num_kv_blocks: int | None = None) -> None:
        """`num_kv_blocks`: a decoder's KV pool (the core's), for the rule of what can ever
        fit; None: no such check (an encoder, or the core before its pool is sized)."""
        from pagedllm.model.resolution import model_resolution
        from pagedllm.worker.device import resolve_device, resolve_dtype

        if config.tensor_parallel_size != 1 or config.data_parallel_size != 1:
            raise ValueError("pooling models run on one device: tensor_parallel_size and data_parallel_size "
                             "must be 1.")
        if config.speculative_config is not None or config.enable_lora:
            raise ValueError("speculative_config and enable_lora apply to generation, not to pooling models.")
        self.config = config
        resolution = (resolution or model_resolution(config)).expect("pooling")
        self.source = resolution.source
        names = config.served_model_names
        self.model_name = names[0] if names else self.source.name
        self.hf_config = resolution.hf_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.architecture = resolution.architecture
        self.is_encoder = resolution.is_encoder
        self.is_classifier = resolution.is_classifier
        self.pooler: PoolerConfig = load_pooler_config(self.source.path, self.is_encoder, config.pooler_config)
        self.max_model_len = self._max_model_len()
        self.num_kv_blocks = None if self.is_encoder else num_kv_blocks
        self.embedding_size = embedding_dimensions(self.pooler, int(self.hf_config.hidden_size))
        if self.pooler.dimensions is not None and self.pooler.dimensions > self.embedding_size:
            raise ValueError(f"pooler_config dimensions={self.pooler.dimensions} is larger than the model's "
                             f"embedding size {self.embedding_size}.")
        self.matryoshka = getattr(self.hf_config, "matryoshka_dimensions", None)
        self.num_labels = int(getattr(self.hf_config, "num_labels", 0) or 0) if self.is_classifier else 0

    @functools.cached_property
    def tokenizer(self) -> Any:
        """Loaded on first use: the engine core reads the description only."""
        from pagedllm.model_source import resolve_tokenizer_source
        from pagedllm.tokenizer import load_tokenizer

        tok = resolve_tokenizer_source(self.config, self.source)
        return load_tokenizer(tok.path, tok.gguf_file)

    # ---- what the model does --------------------------------------------------------------

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """vLLM's task names this model serves: a cross-encoder classifies and scores pairs,
        an embedding model embeds, encodes and scores by cosine similarity."""
        if self.is_classifier:
            return ("classify", "score") if self.num_labels == 1 else ("classify",)
        return ("embed", "encode", "score")

    def check_task(self, task: str) -> None:
        if task not in self.supported_tasks:
            kind = "a classification (cross-encoder) model" if self.is_classifier else "an embedding model"
            raise ValueError(f"{self.model_name} is {kind}: it supports {list(self.supported_tasks)}, "
                             f"not {task!r}.")

    def _max_model_len(self) -> int:
        cfg = self.hf_config
        limit = int(getattr(cfg, "max_position_embeddings", 0) or 0) or 512
        if getattr(cfg, "model_type", "") in ("roberta", "xlm-roberta"):
            limit -= int(cfg.pad_token_id or 0) + 1  # positions start after the padding index
        if self.pooler.max_seq_length:
            limit = min(limit, int(self.pooler.max_seq_length))
        if self.config.max_model_len is not None:
            if self.config.max_model_len > limit:
                raise ValueError(f"max_model_len={self.config.max_model_len} is larger than the model's "
                                 f"maximum of {limit} tokens.")
            limit = self.config.max_model_len
        return limit

    # ---- prompts -------------------------------------------------------------------------

    def _text(self, prompt: PoolingPrompt, params: PoolingParams, pair: str | None) -> tuple[str, str | None]:
        """The text (and pair) a text prompt is tokenized as: the sentence-transformers
        prompt put before it, lower-cased if the model asks; a text far too long refused
        before it is tokenized."""
        if isinstance(prompt, dict) and "prompt" in prompt:
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got "
                             f"{type(prompt).__name__}.")
        if pair is not None and not isinstance(pair, str):
            raise ValueError(f"the second text of a pair must be a string, got {type(pair).__name__}.")
        if pair is None and not self.is_classifier:
            prompt = self.pooler.prompt + prompt
        if self.pooler.lowercase:
            prompt, pair = prompt.lower(), None if pair is None else pair.lower()
        if params.truncate_prompt_tokens is None and len(prompt) + len(pair or "") > 64 * self.max_model_len:
            raise ValueError(f"the input has {len(prompt) + len(pair or '')} characters, far more than the "
                             f"model's maximum of {self.max_model_len} tokens; set truncate_prompt_tokens.")
        return prompt, pair

    def _token_ids(self, prompt: dict, params: PoolingParams) -> list[int]:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("prompt_token_ids must be a non-empty list of integers.")
        vocab = int(self.hf_config.vocab_size)
        for tok in ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
                raise ValueError(f"prompt token id {tok!r} is not an integer in [0, {vocab}).")
        ids = list(ids)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-self._limit(params):]  # vLLM keeps the last tokens of a token-id prompt
        return self._check_len(ids)

    def _limit(self, params: PoolingParams) -> int:
        t = params.truncate_prompt_tokens
        return self.max_model_len if t in (None, -1) else min(t, self.max_model_len)

    def tokenize_many(self, prompts: list[PoolingPrompt], params: PoolingParams,
                      pairs: list[str | None] | None = None) -> list[tuple[list[int], list[int] | None]]:
        """(token ids, token type ids or None) per prompt, the texts in one tokenizer call; a
        prompt that cannot run is a `PromptError` (a ValueError) carrying its index."""
        pairs = pairs if pairs is not None else [None] * len(prompts)
        out: list[Any] = [None] * len(prompts)
        texts, text_pairs, where = [], [], []
        for i, (prompt, pair) in enumerate(zip(prompts, pairs)):
            try:
                if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
                    out[i] = (self._token_ids(prompt, params), None)
                    continue
                text, pair = self._text(prompt, params, pair)
            except ValueError as exc:
                raise PromptError(i, str(exc)) from None
            texts.append(text)
            text_pairs.append(pair)
            where.append(i)
        if texts:
            with_pairs = [p for p in text_pairs if p is not None]
            if with_pairs and len(with_pairs) != len(text_pairs):
                raise ValueError("either every text or none has a pair.")
            truncate = params.truncate_prompt_tokens is not None
            enc = self.tokenizer(texts, text_pairs if with_pairs else None, add_special_tokens=True,
                                 truncation=truncate, max_length=self._limit(params) if truncate else None)
            types = enc.get("token_type_ids") if self.is_encoder else None
            for j, i in enumerate(where):
                try:
                    out[i] = (self._check_len(list(enc["input_ids"][j])),
                              list(types[j]) if types is not None else None)
                except ValueError as exc:
                    raise PromptError(i, str(exc)) from None
        return out

    def tokenize(self, prompt: PoolingPrompt, params: PoolingParams, pair: str | None = None,
                 ) -> tuple[list[int], list[int] | None]:
        """(token ids, token type ids or None) of one prompt; ValueError if it cannot run."""
        try:
            return self.tokenize_many([prompt], params, [pair])[0]
        except PromptError as exc:
            raise ValueError(str(exc)) from None

    def _check_len(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("the input is empty.")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the input has {len(ids)} tokens, more than the model's maximum context length "
                             f"of {self.max_model_len}; shorten it or set truncate_prompt_tokens.")
        if self.num_kv_blocks is not None:
            check_request_fits_pool(len(ids), 1, self.num_kv_blocks, self.config.block_size)
        return ids

    def check_params(self, params: PoolingParams | None) -> PoolingParams:
        """A validated copy of the request's params with its task filled in."""
        if params is not None and not isinstance(params, PoolingParams):
            raise ValueError(f"pooling params must be a PoolingParams, got {type(params).__name__}.")
        params = (params or PoolingParams()).clone()
        params.validate()
        task = params.task or ("classify" if self.is_classifier else "embed")
        params.task = task
        self.check_task(task)
        if task in ("embed", "encode") or (task == "score" and not self.is_classifier):
            check_dimensions(params, self.embedding_size, self.matryoshka)
        elif params.dimensions is not None:
            raise ValueError(f"dimensions applies to embeddings, not to task {task!r}.")
        return params

    def prepare_many(self, request_ids: list[str], prompts: list[PoolingPrompt], params: PoolingParams | None,
                     pairs: list[str | None] | None = None) -> list[tuple[PoolingParams, PoolingWork]]:
        """Validate and tokenize (a ValueError names what is wrong; a `PromptError` which
        prompt); touches no engine state, so the server runs it while the loop thread steps.
        `pairs`: the second texts of a cross-encoder's (query, document) inputs."""
        params = self.check_params(params)
        now = time.time()
        return [(params, PoolingWork(rid, ids, types, now))
                for rid, (ids, types) in zip(request_ids, self.tokenize_many(prompts, params, pairs))]

    def prepare(self, request_id: str, prompt: PoolingPrompt, params: PoolingParams | None = None,
                pair: str | None = None) -> tuple[PoolingParams, PoolingWork]:
        params = self.check_params(params)
        ids, types = self.tokenize(prompt, params, pair)
        return params, PoolingWork(request_id, ids, types, time.time())

"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence as SequenceT

from tqdm.auto import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.engine import LLMEngine, PromptType
from pagedllm.engine.kv_stats import KVCacheStats
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.chat_parts import load_images, multimodal_prompt, parse_conversation
from pagedllm.multimodal.media import MediaPolicy
from pagedllm.outputs import RequestOutput
from pagedllm.pooling.offline import PoolingAPI
from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import apply_chat_template

Conversation = list[dict[str, Any]]


def _best_of(out: RequestOutput, n: int, strip_logprobs: bool) -> RequestOutput:
    """The n samples of highest cumulative logprob, re-indexed 0..n-1."""
    ranked = sorted(out.outputs, key=lambda c: (-(c.cumulative_logprob or 0.0), c.index))[:n]
    kept = [dataclasses.replace(c, index=i, **({"logprobs": None, "cumulative_logprob": None}
                                                if strip_logprobs else {}))
            for i, c in enumerate(ranked)]
    return dataclasses.replace(out, outputs=kept)


def _final_only(params: list) -> list:
    """The batch loop keeps only each request's finished output: ask for that alone
    (`RequestOutputKind.FINAL_ONLY`, as vLLM's `LLM` does), so that no step builds outputs
    nobody reads. The caller's objects are left as they are."""
    copies: dict[int, SamplingParams] = {}
    out = []
    for p in params:
        if isinstance(p, SamplingParams) and p.output_kind is not RequestOutputKind.FINAL_ONLY:
            if id(p) not in copies:
                copies[id(p)] = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            p = copies[id(p)]
        out.append(p)
    return out


class LLM(PoolingAPI):
    """An engine plus a batch loop: submit all prompts, step until all are done.

    Every `EngineConfig` field is a keyword argument (block_size, kv_cache_space,
    max_model_len, max_num_seqs, enable_prefix_caching, ...). `model=None` uses the default
    SmolLM2-135M-Instruct GGUF, downloaded once. A pooling model (`runner="pooling"`, or an
    encoder / headless decoder with runner "auto") gets `embed`, `classify`, `score` and
    `encode` instead of `generate` (pooling/offline.py, docs/pooling.md).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        from pagedllm.model.resolution import model_resolution

        config = EngineConfig.from_kwargs(model=model, **kwargs)
        # One engine for both kinds of model: a pooling model's requests are the core's too
        # (engine/core_pooling.py). The model is resolved once: the engine takes it as is.
        resolution = model_resolution(config)
        self.llm_engine = LLMEngine(config, resolution)
        self._request_counter = itertools.count()
        # image inputs in chat (docs/multimodal.md)
        self._takes_images = resolution.mm_config is not None
        self._media_policy = MediaPolicy.from_config(config)

    def _generation(self) -> LLMEngine:
        if self.llm_engine.pooling_inputs is not None:
            raise ValueError(f"{self.llm_engine.model_name} runs as a pooling model: use embed / classify / "
                             "score / encode; generate, chat and beam_search need a generation model.")
        return self.llm_engine

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "LLM":
        return cls(**{k: getattr(config, k) for k in config.__dataclass_fields__})

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def kv_cache_stats(self) -> KVCacheStats:
        return self.llm_engine.kv_cache_stats()

    def engine_state(self) -> dict[str, Any]:
        """The block map, queues and block tables now, as the server's dashboard shows them
        (docs/dashboard.md has the schema; `python -m pagedllm.tools.kv_map` draws it)."""
        return self.llm_engine.engine_state()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes now (else they leave with this one)."""
        self.llm_engine.shutdown()

    def wait_for_compilation(self, timeout: float | None = None) -> bool:
        """Block until every compiled decode graph is ready (they compile in the background;
        steps run eager meanwhile). True if all compiled; False with `enforce_eager`, off CPU,
        on timeout, or if a compilation failed (those batch sizes stay eager)."""
        return self.llm_engine.model_runner.wait_for_compilation(timeout=timeout)

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters used when none are given: vLLM's defaults, overridden by the model's
        generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens -> max_tokens) unless generation_config="vllm"."""
        return SamplingParams(**self._generation().generation_defaults)

    def generate(
        self,
        prompts: PromptType | SequenceT[PromptType],
        sampling_params: SamplingParams | SequenceT[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: SequenceT[int] | None = None,
        lora_request: LoRARequest | SequenceT[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        Prompts: a string, a list of strings, a `{"prompt_token_ids": [...]}` dict or a list of
        them; a dict may carry a `"cache_salt"` that isolates its prefix cache from requests
        with another salt. `sampling_params`: one for all, or a list with one per prompt
        (None: `get_default_sampling_params()`). `priority`: one per prompt, lower = earlier
        (needs scheduling_policy="priority", as in vLLM). `lora_request`: a LoRA adapter for
        every prompt, or one (or None: the base model) per prompt (needs enable_lora=True).
        """
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._as_params_list(sampling_params, len(prompt_list))
        # best_of > n: sample best_of, keep the n of highest cumulative logprob (vLLM's rule)
        wanted = [(p.n, p.logprobs is None) if p.best_of and p.best_of > p.n else None
                  for p in params_list]
        params_list = [dataclasses.replace(p, n=p.best_of,
                                           logprobs=0 if p.logprobs is None else p.logprobs)
                       if w else p for p, w in zip(params_list, wanted)]
        outs = self._run(prompt_list, params_list, use_tqdm, priority, lora_request)
        return [_best_of(o, *w) if w else o for o, w in zip(outs, wanted)]

    def beam_search(
        self,
        prompts: PromptType | SequenceT[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = True,
        lora_request: LoRARequest | SequenceT[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Beam search for every prompt (transformers' `generate(num_beams=...)` semantics).

        Each RequestOutput holds `beam_width` completions, best score first; a completion's
        `cumulative_logprob` is its sum of token logprobs (the score divides it by
        `len(token_ids) ** length_penalty`). The beams share KV blocks (fork, copy-on-write).
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam_search() takes BeamSearchParams, got {type(params).__name__}.")
        prompt_list = self._as_prompt_list(prompts)
        return self._run(prompt_list, [params] * len(prompt_list), use_tqdm, lora_request=lora_request)

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | SequenceT[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | SequenceT[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate.

        Content may be a string or OpenAI's content parts: `text`, `image_url` (data:, and
        http(s):// or file:// as the media knobs allow) and vLLM's `image_pil` (a PIL image),
        for a model that takes images (docs/multimodal.md); such a conversation becomes
        `{"prompt": text, "multi_modal_data": {"image": [...]}}`."""
        self._generation()
        if not messages:
            raise ValueError("chat() needs at least one message.")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        template = chat_template or self.llm_engine.config.chat_template
        prompts: list[PromptType] = []
        for conv in conversations:
            inputs = parse_conversation(conv, self._takes_images,
                                        self.llm_engine.config.limit_mm_per_prompt, allow_pil=True,
                                        model_name=self.llm_engine.model_name)
            text = apply_chat_template(
                self.get_tokenizer(), inputs.messages, chat_template=template,
                add_generation_prompt=add_generation_prompt,
            )
            if inputs.images:  # the engine's processor expands the image placeholders
                prompts.append(multimodal_prompt(text, load_images(inputs.images, self._media_policy)))
                continue
            # The template already holds the special tokens (BOS etc.): do not add them again.
            ids = self.get_tokenizer().encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        params_list = self._as_params_list(sampling_params, len(prompts))
        return self._run(prompts, params_list, use_tqdm, lora_request=lora_request)

    # ---- internals ------------------------------------------------------------------------

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if prompts and all(isinstance(p, int) for p in prompts):
                raise ValueError(
                    "A flat list of ints is ambiguous: pass {'prompt_token_ids': [...]} instead."
                )
            return list(prompts)
        raise ValueError(f"prompts must be a string, a dict or a list, got {type(prompts).__name__}.")

    def _as_params_list(self, params: Any, n: int) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(
                f"Got {len(params)} SamplingParams for {n} prompts: pass one, or one per prompt."
            )
        return params

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams] | list[BeamSearchParams],
        use_tqdm: bool,
        priority: SequenceT[int] | None = None,
        lora_request: LoRARequest | SequenceT[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        engine = self._generation()
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"Got {len(priority)} priorities for {len(prompts)} prompts: "
                             "pass one per prompt.")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"Got {len(loras)} LoRA requests for {len(prompts)} prompts: pass one, "
                                 "or one per prompt.")
        params = _final_only(params)
        ids = [f"offline-{next(self._request_counter)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p, prio, lora in zip(ids, prompts, params, priorities, loras):
                engine.add_request(rid, prompt, p, priority=prio, lora_request=lora)
                added.append(rid)
        except Exception:
            engine.abort_request(added)  # nothing half-submitted stays in the engine
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        prompt_tokens = output_tokens = 0
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        prompt_tokens += len(out.prompt_token_ids)
                        output_tokens += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(
                            f"est. speed input: {prompt_tokens / elapsed:.2f} toks/s, "
                            f"output: {output_tokens / elapsed:.2f} toks/s", refresh=False
                        )
                        bar.update(1)
                if not engine.has_unfinished_requests() and len(results) < len(ids):
                    raise RuntimeError("The engine stopped with requests unfinished.")
        except BaseException:
            engine.abort_request([r for r in ids if r not in results])
            raise
        finally:
            bar.close()
        return [results[r] for r in ids]

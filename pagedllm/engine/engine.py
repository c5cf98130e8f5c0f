"""LLMEngine: the offline engine in one process: requests in, RequestOutputs out.

It is the front end and the core without IPC: `InputProcessor` (prompt -> token ids, the
limits), `EngineCore` (schedule -> execute -> sample -> update, on token ids) and
`OutputProcessor` (detokenize, stop strings, RequestOutputs). The server puts the same core in
another process (`engine/core_process.py`) and the same output processor in its own.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from pagedllm.config import EngineConfig
from pagedllm.engine.beam_search import beam_params_from_sampling, sampling_params_from_beam
from pagedllm.engine.core import EngineCore
from pagedllm.engine.core_messages import EngineCoreRequest
from pagedllm.engine.dashboard_snapshot import add_request_timings
from pagedllm.multimodal.processing import multimodal_processor
from pagedllm.engine.input_processing import InputProcessor, PromptType
from pagedllm.engine.generation_defaults import load_generation_defaults
from pagedllm.engine.kv_stats import KVCacheStats
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.lora.request import LoRARequest
from pagedllm.model.resolution import ModelResolution
from pagedllm.model_source import resolve_tokenizer_source
from pagedllm.outputs import RequestOutput
from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.core.scheduler_config import check_priority
from pagedllm.pooling.outputs import PoolingRequestOutput
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.work import PoolingWork
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import load_tokenizer

__all__ = ["LLMEngine", "PromptType", "prepare_request"]


def prepare_request(
    inputs: InputProcessor,
    request_id: str,
    prompt: PromptType,
    params: SamplingParams | BeamSearchParams | None,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    priority: int = 0,
    lora_request: LoRARequest | None = None,
) -> tuple[str | None, EngineCoreRequest]:
    """Tokenize and check a request (a ValueError names what is wrong): the prompt's text and
    the core's request. The one front-end rule, offline and in the server."""
    check_priority(priority, inputs.scheduling_policy)
    if lora_request is not None and not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}.")
    beam_params = params if isinstance(params, BeamSearchParams) else None
    if beam_params is not None:
        params = sampling_params_from_beam(beam_params)
    params = params.clone() if params is not None else SamplingParams()
    cache_salt = inputs.cache_salt(prompt, cache_salt)
    prompt_text, prompt_ids, mm_features = inputs.process_prompt(prompt)
    inputs.validate(prompt_ids, params)
    if params.use_beam_search and beam_params is None:
        beam_params = beam_params_from_sampling(params, params.max_tokens)
    return prompt_text, EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling_params=params,
        arrival_time=time.time() if arrival_time is None else arrival_time,
        beam_params=beam_params,
        cache_salt=cache_salt,
        priority=priority,
        lora_request=lora_request,
        mm_features=mm_features,
    )


def pooling_core_request(core_id: str, params: PoolingParams, work: PoolingWork) -> EngineCoreRequest:
    """The core's request of a prepared pooling request (offline and in the server)."""
    return EngineCoreRequest(core_id, work.token_ids, None, work.arrival_time or time.time(),
                             pooling_params=params, token_type_ids=work.token_type_ids)


class LLMEngine:
    """The engine surface: add_request / step / abort_request / has_unfinished_requests."""

    def __init__(self, config: EngineConfig, resolution: ModelResolution | None = None) -> None:
        if config.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size={config.data_parallel_size} applies to the server "
                "(`pagedllm serve --data-parallel-size N`); the offline LLM runs one engine core."
            )
        self.config = config
        self.core = EngineCore(config, resolution=resolution)
        core = self.core
        # A pooling model: its prompt rule (pooling/inputs.py), with the core's KV pool.
        self.pooling_inputs = None if core.pooling is None else core.pooling.inputs
        if self.pooling_inputs is not None:
            if not self.pooling_inputs.is_encoder:
                self.pooling_inputs.num_kv_blocks = core.num_blocks
            self.tokenizer = self.pooling_inputs.tokenizer
        else:
            tok_source = resolve_tokenizer_source(config, core.source)
            self.tokenizer = load_tokenizer(tok_source.path, tok_source.gguf_file)
        self.inputs = InputProcessor(self.tokenizer, core.vocab_size, core.max_model_len,
                                     core.scheduler.check_request_fits,
                                     max_logprobs=config.max_logprobs,
                                     scheduling_policy=config.scheduling_policy,
                                     max_num_seqs=config.max_num_seqs)
        if core.resolution.mm_config is not None:
            self.inputs.multimodal = multimodal_processor(config, core.source)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.startup_seconds = core.startup_seconds
        # generation_config.json's sampling defaults (EngineConfig.generation_config)
        self.generation_defaults = load_generation_defaults(
            config.generation_config, core.source.path, core.source.is_gguf)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(**kwargs))

    # What callers and tests read of the core.
    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def source(self):
        return self.core.source

    @property
    def hf_config(self):
        return self.core.hf_config

    @property
    def model(self):
        return self.core.model

    @property
    def model_runner(self):
        return self.core.model_runner

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv_cache_manager(self):
        return self.core.kv_cache_manager

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def block_size(self) -> int:
        return self.core.block_size

    @property
    def num_blocks(self) -> int:
        return self.core.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.core.num_host_blocks

    @property
    def eos_token_ids(self) -> set[int]:
        return self.core.eos_token_ids

    @property
    def requests(self):
        """The core's request states (sequences, beams), by request id."""
        return self.core.requests

    # ---- requests -------------------------------------------------------------------------

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate, tokenize and queue a request; a request that can never run is rejected here.

        `BeamSearchParams` (or `SamplingParams(use_beam_search=True, n=width)`) make it a beam
        search. `cache_salt`, also accepted as a key of a prompt dict, isolates its prefix cache.
        `priority` (lower = earlier) needs scheduling_policy="priority" unless it is 0.
        `lora_request`: run it with that LoRA adapter (needs enable_lora; docs/lora.md).
        """
        if self.output_processor.has_request(request_id) or request_id in self.core.requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        prompt_text, request = prepare_request(self.inputs, request_id, prompt, params,
                                               arrival_time, cache_salt, priority, lora_request)
        self.core.add_request(request)
        self.output_processor.add_request(
            request_id, prompt_text, request.prompt_token_ids, request.sampling_params,
            request.arrival_time, is_beam=request.beam_params is not None,
            lora_request=request.lora_request,
        )

    def add_pooling_request(self, params: PoolingParams, work: PoolingWork) -> None:
        """Queue a prepared pooling request (`PoolingInputs.prepare_many`: validated and
        tokenized); it finishes with one `PoolingRequestOutput`."""
        if self.output_processor.has_request(work.request_id) or work.request_id in self.core.requests:
            raise ValueError(f"Request id {work.request_id!r} is already in use.")
        self.core.add_request(pooling_core_request(work.request_id, params, work))
        self.output_processor.add_pooling_request(work.request_id, work.token_ids, work.arrival_time)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Drop requests wherever they are; their blocks return to the pool at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.output_processor.abort_request(rid)
        self.core.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one core step; the outputs of the requests that advanced, as their
        `output_kind` asks (FINAL_ONLY: only the finished)."""
        core_outputs = self.core.step()
        processed = self.output_processor.process_outputs(core_outputs.outputs)
        if processed.finish_samples:  # stop strings: free those samples before the next step
            self.core.finish_samples(processed.finish_samples)
        return [out for _, out in processed.request_outputs]

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (else they leave with this process)."""
        self.core.shutdown()

    # ---- statistics -----------------------------------------------------------------------

    def kv_cache_stats(self) -> KVCacheStats:
        return self.core.kv_cache_stats()

    def reset_kv_cache_peak(self) -> None:
        self.core.reset_kv_cache_peak()

    def engine_state(self) -> dict[str, Any]:
        """The dashboard's snapshot (docs/dashboard.md): block map, queues, block tables,
        counters, each request's TTFT / ITL."""
        return add_request_timings(self.core.engine_state(), self.output_processor)

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) -----------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.core.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.core.list_loras()

    def pin_lora(self, lora_int_id: int) -> bool:
        return self.core.pin_lora(lora_int_id)

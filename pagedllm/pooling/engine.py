"""PoolingEngine: pooling requests in, `PoolingRequestOutput`s out, in one continuous loop.

The front half is `PoolingInputs` (inputs.py: the request rule); the back half is a runner:
decoders through the paged engine (`decoder_runner.py`), encoders batched by length
(`encoder_runner.py`). `step()` runs one batch; what finished comes back. The offline `LLM`
runs it in process; the server runs it in its own process (core_process.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import torch

from pagedllm.config import EngineConfig
from pagedllm.model.resolution import ModelResolution
from pagedllm.pooling.inputs import PoolingInputs, PoolingPrompt, PromptError
from pagedllm.pooling.outputs import PoolingOutput, PoolingRequestOutput
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.poolers import classifier_output, finish_embedding
from pagedllm.pooling.work import PoolingWork

__all__ = ["PoolingEngine", "PoolingPrompt", "PromptError"]


@dataclass
class _Pending:
    params: PoolingParams
    prompt_token_ids: list[int]


class PoolingEngine(PoolingInputs):
    """add_request / step / abort_request / has_unfinished_requests, as `LLMEngine`."""

    def __init__(self, config: EngineConfig, resolution: ModelResolution | None = None) -> None:
        from pagedllm.pooling.decoder_runner import DecoderPoolingRunner
        from pagedllm.pooling.encoder_runner import EncoderRunner

        t0 = time.perf_counter()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        super().__init__(config, resolution)
        if self.is_encoder:
            self.runner = EncoderRunner(self.source.path, self.hf_config, self.architecture, self.dtype, self.device,
                                        self.pooler.pooling_type,
                                        config.resolved_max_num_batched_tokens(self.max_model_len),
                                        config.max_num_seqs)
        else:
            self.runner = DecoderPoolingRunner(config, self.source, self.hf_config, self.architecture, self.dtype,
                                               self.device, self.max_model_len, self.pooler.pooling_type,
                                               self.num_kv_blocks)
        self.requests: dict[str, _Pending] = {}
        self.startup_seconds = time.perf_counter() - t0

    def add_prepared(self, params: PoolingParams, work: PoolingWork) -> None:
        if work.request_id in self.requests:
            raise ValueError(f"Request id {work.request_id!r} is already in use.")
        self.requests[work.request_id] = _Pending(params, work.token_ids)
        self.runner.add(work)

    def add_request(self, request_id: str, prompt: PoolingPrompt, params: PoolingParams | None = None,
                    pair: str | None = None) -> list[int]:
        """Validate, tokenize and queue; the prompt's token ids."""
        if request_id in self.requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        params, work = self.prepare(request_id, prompt, params, pair)
        self.add_prepared(params, work)
        return work.token_ids

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            if self.requests.pop(rid, None) is not None:
                self.runner.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[PoolingRequestOutput]:
        outputs = []
        for rid, raw in self.runner.step():
            pending = self.requests.pop(rid, None)
            if pending is None:
                continue
            if self.is_classifier:
                data = classifier_output(raw, self.pooler, pending.params)
            else:
                data = finish_embedding(raw, self.pooler, pending.params)
            outputs.append(PoolingRequestOutput(rid, PoolingOutput(data.cpu()), pending.prompt_token_ids))
        return outputs

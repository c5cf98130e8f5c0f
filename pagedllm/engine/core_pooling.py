"""Pooling models as a task of the one engine core (docs/pooling.md), as in vLLM v1.

A pooling request is a request of the `EngineCore` like any other: the same scheduler and
block manager admit it, run its prompt (a decoder: on the paged KV cache, in chunks when
chunked prefill is on, its full blocks cached for prefix caching like generation's), and when
the step reaches its last prompt token it finishes with a pooled vector instead of a sampled
token; its blocks go back to the pool then. The step plan marks such sequences (`pool`), the
runner returns their final hidden rows (`ModelRunnerOutput.pooled_hidden`) and this module
turns those rows into the request's vector: pooled (last token / mean / [CLS]), through the
sentence-transformers Dense layers, truncated to `dimensions`, normalised; a classifier's logits
through softmax or sigmoid.

Encoders (BERT, XLM-R) have no KV cache: the core schedules their prompts whole (chunked prefill
and prefix caching off) within the step's token budget, over a pool of bookkeeping blocks sized
for one full step (`encoder_pool_blocks`), and pooling/encoder_runner.py runs the encoder.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.model.resolution import ModelResolution
from pagedllm.pooling.inputs import PoolingInputs
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.poolers import classifier_output, finish_embedding, pool


def check_request_kind(is_pooling_request: bool, is_pooling_core: bool, model_name: str) -> None:
    """A generation request to a pooling model, or a pooling request to a generation model: a
    ValueError saying which (the front ends refuse both first; the core checks again)."""
    if is_pooling_request != is_pooling_core:
        kind, other = ("pooling", "generation") if is_pooling_core else ("generation", "pooling")
        raise ValueError(f"{model_name} is a {kind} model: it does not serve {other} requests.")


@dataclass
class PoolingState:
    """A pooling request's part of its `RequestState`."""

    params: PoolingParams
    token_type_ids: list[int]
    rows: list[torch.Tensor] = field(default_factory=list)  # MEAN / CLS: rows of earlier chunks


class CorePooling:
    """The pooling side of a pooling model's core: its description, the request check, the
    vectors."""

    def __init__(self, config: EngineConfig, resolution: ModelResolution) -> None:
        self.config = config
        self.inputs = PoolingInputs(config, resolution)  # the description; the core loads no tokenizer
        self.is_encoder = self.inputs.is_encoder
        self.is_classifier = self.inputs.is_classifier
        self.pooling_type = self.inputs.pooler.pooling_type
        self.max_model_len = self.inputs.max_model_len
        # A cached block has no hidden rows: only a last-token embedding can be served from one.
        self.prefix_caching = (config.enable_prefix_caching and not self.is_encoder
                               and self.pooling_type == "LAST")
        self.chunked_prefill = config.enable_chunked_prefill and not self.is_encoder

    def model_config(self, hf_config: Any) -> Any:
        """A decoder's config as the runner loads it: the headless architecture the model's
        resolution chose (model/resolution.py)."""
        cfg = copy.copy(hf_config)
        cfg.architectures = [self.inputs.architecture]
        return cfg

    def encoder_pool_blocks(self) -> int:
        """An encoder's bookkeeping pool: every sequence of one full step, whole."""
        budget = self.config.resolved_max_num_batched_tokens(self.max_model_len)
        return -(-budget // self.config.block_size) + self.config.max_num_seqs

    def check(self, prompt_ids: list[int], params: PoolingParams | None,
              token_type_ids: list[int] | None) -> PoolingParams:
        """The request's params with its task filled in (a ValueError: it can never run)."""
        if not prompt_ids:
            raise ValueError("the input is empty.")
        params = self.inputs.check_params(params)
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(f"the input has {len(prompt_ids)} tokens, more than the model's maximum context "
                             f"length of {self.max_model_len}.")
        if token_type_ids is not None and len(token_type_ids) != len(prompt_ids):
            raise ValueError(f"token_type_ids has {len(token_type_ids)} entries for {len(prompt_ids)} tokens.")
        return params

    def collect(self, state: PoolingState, start_pos: int, rows: torch.Tensor, last: bool) -> bytes | None:
        """Keep what the pooling needs of this step's rows; at the prompt's `last` step, the
        request's vector (float32 bytes)."""
        if self.is_classifier:
            vec = None if not last else classifier_output(rows[-1], self.inputs.pooler, state.params)
        elif self.pooling_type == "LAST":
            vec = None if not last else finish_embedding(rows[-1], self.inputs.pooler, state.params)
        else:
            if start_pos == 0:  # a first chunk, or a recompute after preemption
                state.rows = []
            if self.pooling_type == "MEAN" or start_pos == 0:
                state.rows.append(rows.float() if self.pooling_type == "MEAN" else rows[:1].float())
            vec = None
            if last:
                vec = finish_embedding(pool(torch.cat(state.rows), self.pooling_type), self.inputs.pooler,
                                       state.params)
                state.rows = []
        return None if vec is None else vec.float().cpu().numpy().tobytes()

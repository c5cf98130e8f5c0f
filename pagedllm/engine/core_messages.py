"""What the front end and the engine core say to each other (vLLM v1's protocol, on msgspec).

In: an `EngineCoreRequest` carries token ids, never text (the front end tokenizes). Out: one
`EngineCoreOutputs` per core step, holding for every request that advanced only what is *new*
(`SampleDelta`: the step's token ids and their logprobs), never cumulative copies, and a
`CoreStats` snapshot for the gauges. The front end (`engine/output_processor.py`) detokenizes,
checks stop strings and assembles `RequestOutput`s.

The same objects travel in process (the offline `LLMEngine`) and over ZeroMQ as msgpack
(`engine/core_client.py`): `encode` / `decode_*` are the only wire functions. Logprobs are
compact tuples here (`(token_id, logprob, rank)` plus the top-k `(token_id, logprob)` pairs)
and become `Logprob` dicts with decoded text in the front end.
"""

from __future__ import annotations

import enum

import os
from typing import Any

import msgspec

from pagedllm.core.kv_cache_groups import layer_sliding_windows
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.pooling.params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class EngineCoreRequestType(enum.IntEnum):
    """The first frame of a message to the core: what the second frame is."""

    ADD = 0
    ABORT = 1  # list of request ids
    FINISH_SAMPLES = 2  # list of (request id, sample index): stopped by a stop string
    UTILITY = 3  # (name, args): reset_prefix_cache, ...
    SHUTDOWN = 4


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None  # None: a pooling request (`pooling_params`)
    arrival_time: float
    beam_params: BeamSearchParams | None = None
    cache_salt: str | None = None
    priority: int = 0  # lower = earlier, under the "priority" scheduling policy
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    # A pooling model's request (docs/pooling.md): it finishes after its prompt with a vector.
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None  # an encoder's segment ids (a cross-encoder's pair)
    # Its images (docs/multimodal.md): tensors, content hashes and placeholder runs, in prompt order.
    mm_features: list[MultiModalFeature] | None = None


# (token id, logprob, rank, top-k [(token id, logprob), ...] in rank order)
TokenLogprob = tuple[int, float, int, list[tuple[int, float]]]
# One prompt position: {token id: (logprob, rank)}; None for the first position.
PromptLogprobEntry = dict[int, tuple[float, int]] | None


class SampleDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one sample (index `index` of the request's n) gained in one step."""

    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    # set on the step the core finished the sample: "stop" (EOS / stop token), "length", "abort"
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id, when one ended it


class BeamCompletion(msgspec.Struct, array_like=True, omit_defaults=True):
    """A finished beam hypothesis (beam search reports once, at the end). The front end
    decodes the first `num_text_tokens` of `token_ids` (a stop token's text is left out)."""

    index: int
    token_ids: list[int]
    num_text_tokens: int
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    samples: list[SampleDelta] = []
    finished: bool = False  # the core holds nothing of the request any more
    new_prompt_logprobs: list[PromptLogprobEntry] | None = None
    num_cached_tokens: int | None = None  # sent once, with the first scheduling
    first_scheduled_time: float | None = None  # likewise
    beam_completions: list[BeamCompletion] | None = None
    error: str | None = None  # the core rejected or failed the request (ValueError text)
    # "invalid" (the client's fault: 400) / "stall" / "internal" (500) / "fatal" (503)
    error_kind: str | None = None
    pooled: bytes | None = None  # a pooling request's vector: float32, native byte order


class CoreStats(msgspec.Struct, array_like=True):
    """The scheduler and KV cache gauges and counters after a step (metrics.py)."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_used_blocks: int = 0
    kv_num_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Steps that ran a batch (cumulative), and the tokens each fed to the model since the last
    # CoreStats (vllm:iteration_tokens_total): a new step always makes the stats differ, so
    # core_loop's "send if changed" never drops a step's count.
    num_steps: int = 0
    iteration_tokens: list[int] = []
    # A hybrid or sliding KV cache (docs/hybrid_kv_cache.md): blocks each group holds now
    # (empty: one table for every layer), and the blocks sliding windows gave back, cumulative.
    kv_used_blocks_by_group: list[int] = []
    sliding_blocks_freed: int = 0
    # Speculative decoding, cumulative (vLLM's vllm:spec_decode_* counters); empty per-position
    # list: speculation off.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # Multi-LoRA (vllm:lora_requests_info): the adapter slots, and the adapters of running and of
    # waiting requests by name; max_lora 0: LoRA off.
    max_lora: int = 0
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    # Image inputs (core/encoder_cache.py), cumulative but the rows held: each sequence's first
    # need of an image and the hits among them (vLLM's vllm:mm_cache_*), images and rows encoded.
    mm_cache_queries: int = 0
    mm_cache_hits: int = 0
    mm_images_encoded: int = 0
    mm_rows_encoded: int = 0
    encoder_cache_rows: int = 0
    encoder_cache_capacity: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: CoreStats | None = None
    timestamp: float = 0.0
    engine_index: int = 0  # the data-parallel replica that sent it
    utility_result: tuple[int, str, bool] | None = None  # (call id, repr result, ok)
    health_error: str | None = None  # a scheduler stall was seen: /health turns 503
    fatal_error: str | None = None  # the core stops (engine/core_loop.py): 503, then exit


class CoreReady(msgspec.Struct):
    """The core's hand-shake once its model is loaded (or the error it failed with)."""

    ok: bool
    error: str | None = None
    error_is_value_error: bool = False
    num_blocks: int = 0
    block_size: int = 16
    max_model_len: int = 0
    max_num_batched_tokens: int = 0
    model_name: str = ""
    vocab_size: int = 0
    eos_token_ids: list[int] = []
    startup_seconds: float = 0.0
    kernel_info: dict[str, str] = {}
    pid: int = 0
    # Each layer's attention window (None: full); empty where the KV cache is not hybrid
    # (`--disable-hybrid-kv-cache-manager` included): the front end's KV cache groups.
    hybrid_layer_windows: list[int | None] = []


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
_ready_decoder = msgspec.msgpack.Decoder(CoreReady)


def encode(obj: object) -> bytes:
    return _encoder.encode(obj)


def decode_request(data: bytes) -> EngineCoreRequest:
    return _request_decoder.decode(data)


def decode_outputs(data: bytes) -> EngineCoreOutputs:
    return _outputs_decoder.decode(data)


def decode_ready(data: bytes) -> CoreReady:
    return _ready_decoder.decode(data)


def decode_any(data: bytes) -> object:
    return msgspec.msgpack.decode(data)


def request_id_of(data: bytes) -> str | None:
    """The request id of an ADD payload that failed to decode into an `EngineCoreRequest`
    (its first array item), so that the core can answer that request; None if unreadable."""
    try:
        raw = msgspec.msgpack.decode(data)
    except Exception:
        return None
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return raw[0]
    return None


def ready_info(core: Any) -> CoreReady:
    """The hand-shake numbers of an in-process core (what a core process sends)."""
    return CoreReady(
        ok=True, num_blocks=getattr(core, "num_blocks", 0),
        block_size=getattr(core, "block_size", 16),
        max_model_len=getattr(core, "max_model_len", 0),
        max_num_batched_tokens=getattr(core, "max_num_batched_tokens", 0),
        model_name=getattr(core, "model_name", ""), vocab_size=getattr(core, "vocab_size", 0),
        eos_token_ids=sorted(getattr(core, "eos_token_ids", ())),
        startup_seconds=getattr(core, "startup_seconds", 0.0), pid=os.getpid(),
        hybrid_layer_windows=hybrid_layer_windows(core),
    )


def hybrid_layer_windows(core: Any) -> list[int | None]:
    """The hand-shake's per-layer windows: empty unless the core's KV cache is hybrid."""
    if getattr(core, "kv_cache_groups", None) is None:
        return []
    return layer_sliding_windows(core.hf_config)

"""What the server's front end knows of the engine it fronts (from the cores' hand-shakes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineInfo:
    """What the server needs to know of the engine it fronts (from the core's hand-shake)."""

    model_name: str
    model_root: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    chat_template: str | None
    startup_seconds: float
    kernel_info: dict[str, str]
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20
    max_num_seqs: int = 256  # bounds n / best_of / the beam width of a request
    # generation_config.json's sampling defaults (engine/generation_defaults.py)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # every --served-model-name (model_name is the first); empty: model_name only
    served_model_names: list[str] = field(default_factory=list)
    # a hybrid KV cache (the core's KVCacheManager groups) and the step's token budget: the
    # fit check's peak per sequence (core/scheduler.check_request_fits_pool)
    kv_cache_groups: Any = None
    max_num_batched_tokens: int = 0
    # image inputs (docs/multimodal.md): whether the model takes them, limit_mm_per_prompt,
    # and where images may come from (multimodal/media.MediaPolicy; None: the defaults)
    takes_images: bool = False
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    media_policy: Any = None

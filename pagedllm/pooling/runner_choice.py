"""Which engine a model gets: generation (`LLMEngine`) or pooling (`PoolingEngine`).
vLLM's rule: `--runner pooling` / `--task embed|classify|score` ask for pooling; `auto`
takes pooling for an encoder or a headless `*Model` decoder (nothing to generate with)."""

from __future__ import annotations

import json
import os

from pagedllm.config import EngineConfig

POOLING_ARCH_SUFFIXES = ("Model", "ForSequenceClassification")


def is_pooling_config(config: EngineConfig) -> bool:
    wanted = config.requested_runner
    if wanted != "auto":
        return wanted == "pooling"
    if config.model is None or config.model.endswith(".gguf") or config.gguf_file:
        return False
    from pagedllm.model_source import load_hf_config, resolve_model_source

    try:
        source = resolve_model_source(config)
        if source.is_gguf:
            return False
        archs = _architectures(source.path) or getattr(load_hf_config(source), "architectures", None)
    except (OSError, ValueError):
        return False  # the generation engine reports it
    return any(a.endswith(POOLING_ARCH_SUFFIXES) for a in archs or [])


def _architectures(folder: str) -> list[str] | None:
    """`architectures` of the folder's config.json, read as JSON: transformers' config classes
    cost `pagedllm serve` seconds of imports before its engine cores could start."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        archs = json.load(f).get("architectures")
    return archs if isinstance(archs, list) else None

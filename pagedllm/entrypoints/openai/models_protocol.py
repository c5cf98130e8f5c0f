"""The /v1/models listing and vLLM's LoRA adapter load / unload bodies."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol_base import OpenAIBaseModel, now_seconds


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_seconds)
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's POST /v1/unload_lora_adapter body (the name, or vLLM's lora_int_id)."""

    lora_name: str | None = None
    lora_int_id: int | None = None

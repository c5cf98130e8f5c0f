"""`LoRARequest`: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`).

A msgspec struct (msgpack array, defaults omitted) like the core's other messages
(engine/core_messages.py), so it travels inside them unchanged. `__post_init__` runs on
construction and on decode, so a bad request is refused the same way offline, in process and
across the process boundary (a decode raises `msgspec.ValidationError`, a ValueError).

Identity: `lora_int_id` names one adapter for the engine's lifetime (the worker's cache and slots
are keyed by it), so equality and hash go by `lora_int_id` (vLLM's `AdapterRequest` rule; newer
vLLM releases compare by `lora_name` instead). No torch here: the front end imports this module.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """An adapter: a display name, a unique id > 0 (0 / -1 mean "no adapter" in the batch
    mappings), and the folder it is loaded from (docs/lora.md)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    long_lora_max_len: int | None = None
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer > 0, got {self.lora_int_id!r} "
                             f"(adapter {self.lora_name!r})")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path cannot be empty (adapter {self.lora_name!r}): "
                             "give the adapter's folder")
        if self.long_lora_max_len is not None:
            raise ValueError(f"LoRARequest.long_lora_max_len={self.long_lora_max_len!r} (adapter {self.lora_name!r}): "
                             "LongLoRA adapters (scaled rope per adapter) are not supported")
        if self.tensorizer_config_dict is not None:
            raise ValueError(f"LoRARequest.tensorizer_config_dict is set (adapter {self.lora_name!r}): "
                             "tensorizer-serialized adapters are not supported; give a PEFT folder")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_int_id == other.lora_int_id

    def __hash__(self) -> int:
        return hash(self.lora_int_id)

"""A PEFT `adapter_config.json` read as PEFT reads it, with everything not built refused by name.

Read without importing peft (a test-only dependency): the fields that change the arithmetic are
few, and each rule is PEFT's own (peft/tuners/tuners_utils.py `check_target_module_exists`,
peft/utils/other.py `get_pattern_key`, peft/tuners/lora/layer.py `update_layer`):

- scaling = `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`, per module with its
  own r / alpha from `rank_pattern` / `alpha_pattern` (the first key `k` for which the module's
  name matches `(.*\\.)?(k)$`);
- `target_modules`: a list (a module matches when its name equals an entry or ends with
  `.entry`), a regex string (`re.fullmatch` on the module's name) or "all-linear" (every
  projection, not the LM head); `exclude_modules` likewise (list or regex).

A field that is not in `_INERT_FIELDS` (read or meaningless at inference) and not at its neutral
value is refused: the known ones with a reason (`_REFUSED`), a field this module does not know
(a newer PEFT's method) by its name, rather than served with arithmetic that ignores it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from pagedllm.lora.model_spec import LoRAModelSpec

# read below, or meaningless once trained (initialisation, dropout, training-time options)
_INERT_FIELDS = frozenset({
    "peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules", "rank_pattern",
    "alpha_pattern", "base_model_name_or_path", "bias", "init_lora_weights", "loftq_config", "eva_config",
    "corda_config", "lora_dropout", "inference_mode", "task_type", "revision", "auto_mapping", "peft_version",
    "megatron_core", "qalora_group_size", "ensure_weight_tying",
})
# field -> why it is refused when set (not None / False / empty)
_REFUSED = {
    "use_dora": "DoRA adapters (a learned magnitude per output feature) are not supported",
    "modules_to_save": "fully trained copies of modules (modules_to_save) are not supported, only low-rank deltas",
    "fan_in_fan_out": "fan_in_fan_out (transposed Conv1D weights, GPT-2 style) is not supported",
    "lora_bias": "a bias on lora_B (lora_bias) is not supported",
    "layers_to_transform": "adapting only some layers (layers_to_transform) is not supported",
    "layers_pattern": "layers_pattern (with layers_to_transform) is not supported",
    "layer_replication": "layer_replication (layers repeated by the adapter) is not supported",
    "target_parameters": "LoRA on parameters (target_parameters, e.g. MoE experts) is not supported",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices) are not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "arrow_config": "Arrow routing over several adapters (arrow_config) is not supported",
    "megatron_config": "Megatron parallel layers (megatron_config) are not supported",
}


@dataclass(frozen=True)
class PEFTLoRAConfig:
    """The fields of an adapter_config.json that pagedllm uses."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: str | tuple[str, ...]
    exclude_modules: str | tuple[str, ...] | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    base_model_name_or_path: str | None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str) -> PEFTLoRAConfig:
        """Check `raw` (the JSON of file `where`, named in every error) and keep what is used."""
        peft_type = raw.get("peft_type", "LORA")
        if str(peft_type).upper() != "LORA":
            raise ValueError(f"{where}: peft_type={peft_type!r} is not supported: only LoRA adapters are")
        for name, value in raw.items():
            if name in _REFUSED and value:
                raise ValueError(f"{where}: {name}={value!r}: {_REFUSED[name]}")
            if name not in _INERT_FIELDS and name not in _REFUSED and value not in (None, False, "", [], {}):
                raise ValueError(f"{where}: {name}={value!r} is not supported (a PEFT option pagedllm does not "
                                 "know; only plain LoRA deltas are served)")
        if raw.get("bias", "none") != "none":
            raise ValueError(f"{where}: bias={raw['bias']!r}: adapter biases are not supported (only bias='none')")
        r = raw.get("r")
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"{where}: r must be a positive integer, got {r!r}")
        alpha = raw.get("lora_alpha", 8)  # PEFT's default
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise ValueError(f"{where}: lora_alpha must be a finite number, got {alpha!r}")
        rank_pattern = dict(raw.get("rank_pattern") or {})
        for key, value in rank_pattern.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: rank_pattern[{key!r}] must be a positive integer, got {value!r}")
        alpha_pattern = dict(raw.get("alpha_pattern") or {})
        for key, value in alpha_pattern.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{where}: alpha_pattern[{key!r}] must be a finite number, got {value!r}")
        return cls(r, float(alpha), bool(raw.get("use_rslora", False)),
                   _module_names(raw.get("target_modules"), "target_modules", where),
                   _module_names(raw.get("exclude_modules"), "exclude_modules", where, optional=True),
                   rank_pattern, {k: float(v) for k, v in alpha_pattern.items()},
                   raw.get("base_model_name_or_path") or None)

    def is_target(self, key: str) -> bool:
        """Whether PEFT adapts module `key` (transformers' name, `model.layers.0.self_attn.q_proj`)."""
        if self.exclude_modules and _matches(self.exclude_modules, key):
            return False
        if self.target_modules == "all-linear":
            return not key.endswith("lm_head")
        return _matches(self.target_modules, key)

    def rank_of(self, key: str) -> int:
        return self.rank_pattern.get(_pattern_key(self.rank_pattern, key), self.r)

    def alpha_of(self, key: str) -> float:
        return self.alpha_pattern.get(_pattern_key(self.alpha_pattern, key), self.lora_alpha)

    def scaling_of(self, key: str) -> float:
        r = self.rank_of(key)
        return self.alpha_of(key) / (math.sqrt(r) if self.use_rslora else r)

    @property
    def scaling(self) -> float:
        """The default scaling (modules without a rank / alpha pattern)."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def targets(self, spec: LoRAModelSpec, where: str) -> dict[tuple[int, str], str]:
        """`(layer, checkpoint module) -> module name` of every module the adapter adapts in a
        model of `spec`; ValueError for a target the model lacks or that pagedllm does not adapt."""
        found: dict[tuple[int, str], str] = {}
        for layer in range(spec.num_layers):
            for module in spec.checkpoint_modules:
                key = spec.module_key(layer, module)
                if self.is_target(key):
                    found[layer, module] = key
        for key in ("model.embed_tokens", "lm_head"):
            if self.target_modules != "all-linear" and self.is_target(key):
                leaf = key.rpartition(".")[2]
                raise ValueError(f"{where}: target_modules {_show(self.target_modules)} selects {leaf}: LoRA on "
                                 "the embeddings / LM head is not supported")
        known = [spec.module_key(0, m) for m in spec.checkpoint_modules] + ["model.embed_tokens", "lm_head"]
        if isinstance(self.target_modules, tuple):
            for entry in self.target_modules:
                if not any(_matches((entry,), spec.module_key(layer, m)) for layer in range(spec.num_layers)
                           for m in spec.checkpoint_modules):
                    raise ValueError(f"{where}: target module {entry!r} is not a module of {spec.architecture} "
                                     f"(its LoRA modules: {sorted(spec.checkpoint_modules)})")
        if not found:
            raise ValueError(f"{where}: target_modules {_show(self.target_modules)} selects no module of "
                             f"{spec.architecture} (modules such as {known})")
        return found


def _module_names(value: Any, field: str, where: str, optional: bool = False) -> str | tuple[str, ...] | None:
    """A list as a tuple, a string as it is (a regex, or "all-linear")."""
    if value is None and optional:
        return None
    if isinstance(value, str):
        if value.lower() == "all-linear":
            return "all-linear"
        try:
            re.compile(value)
        except re.error as e:
            raise ValueError(f"{where}: {field} {value!r} is not a valid regular expression: {e}") from None
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    if optional and isinstance(value, (list, tuple)) and not value:
        return None
    raise ValueError(f"{where}: {field} must be a list of module names or a regex string, got {value!r}")


def _matches(names: str | tuple[str, ...], key: str) -> bool:
    """PEFT's rule: a regex string matches the whole name; a list entry the name or its tail."""
    if isinstance(names, str):
        return re.fullmatch(names, key) is not None
    return any(key == n or key.endswith(f".{n}") for n in names)


def _pattern_key(patterns: dict[str, Any], key: str) -> str:
    """PEFT's `get_pattern_key`: the first pattern that matches the end of `key`, else `key`."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return key


def _show(names: str | tuple[str, ...]) -> str:
    return repr(names) if isinstance(names, str) else repr(list(names))

"""Which quantization a checkpoint has: `config.json`'s `quantization_config` (auto-detection)
or a GGUF file, checked against the user's `quantization=`, and the compute `quant_compute`
"auto" picks; one config class per format (formats/).

`get_quantization_config(hf_config, forced, is_gguf)` is what the model loader calls.
"""

from __future__ import annotations

from typing import Any

from pagedllm.quantization.formats.awq import AWQConfig
from pagedllm.quantization.formats.base import QuantizationConfig
from pagedllm.quantization.formats.compressed_tensors import CompressedTensorsConfig
from pagedllm.quantization.formats.gguf import GGUFConfig
from pagedllm.quantization.formats.gptq import GPTQConfig

QUANTIZATION_CONFIGS: dict[str, type[QuantizationConfig]] = {
    "gptq": GPTQConfig,
    "awq": AWQConfig,
    "compressed-tensors": CompressedTensorsConfig,
}
# names other tools write for the same formats (vLLM's kernel-specific names, underscores)
_ALIASES = {"compressed_tensors": "compressed-tensors", "gptq_marlin": "gptq", "awq_marlin": "awq"}


def normalize_method_name(name: str) -> str:
    name = str(name).lower()
    return _ALIASES.get(name, name)


def checkpoint_quantization(hf_config: Any) -> dict[str, Any] | None:
    """`quantization_config` of the model's config as a dict (None: not quantized)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return qc


def resolve_compute(compute: str, is_gguf: bool) -> str:
    """`quant_compute` "auto": int8 activations for AWQ / GPTQ / compressed-tensors checkpoints
    (perplexity within 0.5% of exact, docs/quantization.md), exact for GGUF files (greedy
    parity with transformers float32 is pinned there)."""
    if compute not in ("auto", "exact", "int8"):
        raise ValueError(f"quant_compute must be 'auto', 'exact' or 'int8', got {compute!r}")
    if compute == "auto":
        return "exact" if is_gguf else "int8"
    return compute


def get_quantization_config(hf_config: Any, forced: str | None, is_gguf: bool = False,
                            compute: str = "auto") -> QuantizationConfig | None:
    """The checkpoint's quantization config (None: float weights; GGUFConfig for a GGUF file). `forced` is the user's
    `quantization=`: it must agree with what the checkpoint says (ValueError otherwise).
    `compute` is the engine's `quant_compute` (see `resolve_compute`)."""
    forced = normalize_method_name(forced) if forced is not None else None
    if is_gguf:
        if forced not in (None, "gguf"):
            raise ValueError(f"quantization={forced!r} was given, but the model is a GGUF file "
                             "(use quantization='gguf' or none)")
        config = GGUFConfig()
        config.compute = resolve_compute(compute, is_gguf)
        return config
    qc = checkpoint_quantization(hf_config)
    detected = normalize_method_name(qc.get("quant_method", "")) if qc is not None else None
    if forced == "gguf":
        raise ValueError("quantization='gguf' was given, but the model is not a GGUF file"
                         + (f" (its config says quant_method {detected!r})" if detected else ""))
    if qc is None:
        if forced is not None:
            raise ValueError(f"quantization={forced!r} was given, but the checkpoint's config.json has no "
                             "quantization_config (it is not a quantized checkpoint)")
        return None
    if not detected:
        raise ValueError("The checkpoint's quantization_config has no quant_method")
    if forced is not None and forced != detected:
        raise ValueError(f"quantization={forced!r} was given, but the checkpoint's quantization_config says "
                         f"quant_method {detected!r}")
    cls = QUANTIZATION_CONFIGS.get(detected)
    if cls is None:
        raise ValueError(f"Quantization method {detected!r} (config.json's quant_method) is not supported. "
                         f"Supported: {sorted(QUANTIZATION_CONFIGS)} and GGUF files")
    config = cls.from_config(qc)
    config.compute = resolve_compute(compute, is_gguf)
    return config


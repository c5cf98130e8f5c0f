"""Hugging Face architecture name -> what pagedllm runs it with, per runner.

generate: pagedllm's decoder classes. pooling: the same decoders without their LM head
(paged, `decoder_embedders.py`) and BERT-family encoders (run by transformers). The table names
each class by module and attribute and imports it only when a config asks for it (as vLLM's
registry does), and this module imports neither torch nor transformers: `pagedllm serve`
decides the runner from it before its engine cores start (model/resolution.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

# generate runner: HF `architectures` entry -> (module under pagedllm.model, class name)
GENERATE_ARCHS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    # the language model of Qwen2-VL / Qwen2.5-VL (Qwen2 with M-RoPE), run under those archs
    "Qwen2VLTextForCausalLM": ("qwen2_vl", "Qwen2VLTextForCausalLM"),
}

# generate runner, multimodal (docs/multimodal.md): HF architecture -> the model_type of the text
# model it must have (its pagedllm class comes from `_MODEL_TYPE_TO_ARCH`); the vision encoder is
# model/vision_encoders.py's. Their configs reach the engine as the text config with the whole
# config as `multimodal_config` (model/resolution.py).
MULTIMODAL_ARCHS: dict[str, tuple[str, ...]] = {
    "LlavaForConditionalGeneration": ("llama", "mistral", "qwen2"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl_text",),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl_text",),
    "LlavaNextForConditionalGeneration": ("llama", "mistral", "qwen2"),
    "Idefics3ForConditionalGeneration": ("llama",),
    "SmolVLMForConditionalGeneration": ("llama",),
    "Gemma3ForConditionalGeneration": ("gemma3_text",),
}

# pooling runner, decoders: headless classes (no LM head), paged like generation
HEADLESS_ARCHS: dict[str, tuple[str, str]] = {
    "LlamaModel": ("decoder_embedders", "LlamaModel"),
    "MistralModel": ("decoder_embedders", "LlamaModel"),
    "Qwen2Model": ("decoder_embedders", "LlamaModel"),
    "Qwen3Model": ("decoder_embedders", "Qwen3Model"),
}
# a generation architecture -> the headless one the pooling runner loads instead
HEADLESS_OF = {
    "LlamaForCausalLM": "LlamaModel",
    "MistralForCausalLM": "MistralModel",
    "Qwen2ForCausalLM": "Qwen2Model",
    "Qwen3ForCausalLM": "Qwen3Model",
}

# pooling runner, encoders: loaded by transformers (pooling/encoder_runner.py)
ENCODER_EMBED_ARCHS = ("BertModel", "RobertaModel", "XLMRobertaModel")
ENCODER_CLASSIFY_ARCHS = ("BertForSequenceClassification", "RobertaForSequenceClassification",
                          "XLMRobertaForSequenceClassification")
# Recognised and refused by name, with the reason (transformers has them; pagedllm does not test them).
REFUSED_ARCHS = {
    "ModernBertModel": "ModernBERT is not supported yet (its alternating local/global attention is untested here)",
    "ModernBertForSequenceClassification": "ModernBERT is not supported yet",
    "BertForMaskedLM": "masked-LM heads are not a pooling task",
}

# Configs read from a GGUF file carry no `architectures`; fall back on `model_type`.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_vl_text": "Qwen2VLTextForCausalLM",
    "qwen2_5_vl_text": "Qwen2VLTextForCausalLM",
}


def supported_architectures() -> dict[str, list[str]]:
    """What each runner runs: {"generate": [...], "pooling": [...]}."""
    return {"generate": list(GENERATE_ARCHS) + list(MULTIMODAL_ARCHS),
            "pooling": [*ENCODER_EMBED_ARCHS, *ENCODER_CLASSIFY_ARCHS, *HEADLESS_ARCHS, *HEADLESS_OF]}


def unsupported_error(archs: list[str]) -> ValueError:
    supported = supported_architectures()
    return ValueError(f"Model architecture(s) {archs} are not supported by pagedllm. Supported architectures: "
                      f"generate: {supported['generate']}; pooling: {supported['pooling']}.")


def architecture_names(architectures: list[str] | None, model_type: str | None) -> list[str]:
    """The names a config asks for: its `architectures`, else (GGUF configs) its `model_type`'s."""
    if architectures:
        return list(architectures)
    return [_MODEL_TYPE_TO_ARCH.get(model_type or "", str(model_type))]


def architecture_of(hf_config: Any) -> str:
    """The generation architecture a config asks for; ValueError naming what is supported."""
    archs = architecture_names(getattr(hf_config, "architectures", None), getattr(hf_config, "model_type", None))
    for arch in archs:
        if arch in GENERATE_ARCHS:
            return arch
    raise unsupported_error(archs)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """pagedllm's class for the config's generation or headless decoder architecture (which
    runner may run it is model/resolution.py's decision); ValueError for any other."""
    mm_config = getattr(hf_config, "multimodal_config", None)
    if mm_config is not None:
        return model_class(mm_config.architectures[0], hf_config)
    archs = architecture_names(getattr(hf_config, "architectures", None), getattr(hf_config, "model_type", None))
    for arch in archs:
        if arch in GENERATE_ARCHS or arch in HEADLESS_ARCHS:
            return model_class(arch)
    raise unsupported_error(archs)


def text_architecture(mm_arch: str, text_config: Any) -> str:
    """The generation architecture of a multimodal model's text part; ValueError if pagedllm
    does not run that text model under this architecture."""
    model_type = getattr(text_config, "model_type", None)
    if model_type not in MULTIMODAL_ARCHS[mm_arch]:
        raise ValueError(f"{mm_arch} with a {model_type!r} language model is not supported; its text model "
                         f"must be one of {list(MULTIMODAL_ARCHS[mm_arch])}.")
    return _MODEL_TYPE_TO_ARCH[model_type]


def model_class(arch: str, text_config: Any = None) -> type[nn.Module]:
    """pagedllm's class for a generation or headless decoder architecture (imported now); a
    multimodal one's is its text model's class with the vision encoder (model/multimodal.py)."""
    if arch in MULTIMODAL_ARCHS:
        from pagedllm.model.multimodal import multimodal_class

        return multimodal_class(arch, model_class(text_architecture(arch, text_config)))
    module_name, class_name = GENERATE_ARCHS.get(arch) or HEADLESS_ARCHS[arch]
    module = importlib.import_module(f"pagedllm.model.{module_name}")
    return getattr(module, class_name)

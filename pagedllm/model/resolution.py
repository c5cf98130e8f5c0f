"""What a model is and how it runs, decided in one place: its architecture, its runner
("generate" or "pooling", vLLM's rule) and how it loads (GGUF file or HF folder; a pagedllm
class from the registry, or a transformers encoder).

vLLM's rule: `runner="pooling"` / `task="embed|classify|score"` ask for pooling, "generate" for
generation; "auto" takes pooling for an encoder or a headless `*Model` decoder (nothing to
generate with), generation otherwise. An architecture neither runner runs is a ValueError naming
it and listing what each runner supports, before anything is loaded.

`model_resolution(config)` is called once per process that holds the model or its request rule
(LLM, an engine core, the pooling front end). `pagedllm serve` asks `serving_runner(config)`
before its cores start: it reads config.json as JSON and imports neither torch nor
transformers (their imports cost the front end seconds it overlaps with the cores' start-up).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pagedllm.model import registry
from pagedllm.model_source import ModelSource, load_hf_config, resolve_model_source

if TYPE_CHECKING:
    from torch import nn

    from pagedllm.config import EngineConfig

Runner = Literal["generate", "pooling"]
GGUF_POOLING = "GGUF embedding models are not supported; use the model's safetensors folder or Hub id."


@dataclass(frozen=True)
class ArchitectureChoice:
    """The registered architecture that runs (for a generation decoder under the pooling runner:
    its headless form) and the runner it runs under."""

    architecture: str
    runner: Runner
    is_encoder: bool


@dataclass(frozen=True)
class ModelResolution:
    """The model's files, its transformers config and the decision made from them."""

    source: ModelSource
    hf_config: Any
    architecture: str
    runner: Runner
    is_encoder: bool

    @property
    def is_gguf(self) -> bool:
        return self.source.is_gguf

    @property
    def is_pooling(self) -> bool:
        return self.runner == "pooling"

    @property
    def is_classifier(self) -> bool:
        """A cross-encoder (classification head) rather than an embedding model."""
        return self.architecture in registry.ENCODER_CLASSIFY_ARCHS

    def expect(self, runner: Runner) -> ModelResolution:
        """This resolution, for an engine built for `runner`; a ValueError if the model runs
        under the other (an engine built directly, without LLM or the server choosing)."""
        if self.runner != runner:
            raise ValueError(f"{self.architecture} runs as a {self.runner} model (runner={self.runner!r}); "
                             f"this engine runs {runner} models.")
        return self

    def model_class(self) -> type[nn.Module]:
        """pagedllm's class for a decoder (imported now); an encoder is transformers'
        (`AutoModel` / `AutoModelForSequenceClassification`, pooling/encoder_runner.py)."""
        if self.is_encoder:
            raise ValueError(f"{self.architecture} is an encoder: transformers loads it, not a pagedllm class.")
        return registry.model_class(self.architecture, self.hf_config)

    @property
    def mm_config(self) -> Any:
        """The whole config of a multimodal model (None: text only); `hf_config` is its text part."""
        return getattr(self.hf_config, "multimodal_config", None)


def choose_architecture(archs: list[str], requested: str, is_gguf: bool) -> ArchitectureChoice:
    """The first of `archs` (a config's `architectures`, in order) a runner runs, under the
    runner `requested` ("auto", "generate" or "pooling"); ValueError otherwise."""
    if requested not in ("auto", "generate", "pooling"):
        raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {requested!r}.")
    for arch in archs:
        if arch in registry.REFUSED_ARCHS:
            raise ValueError(f"{arch}: {registry.REFUSED_ARCHS[arch]}.")
        if arch in registry.ENCODER_EMBED_ARCHS or arch in registry.ENCODER_CLASSIFY_ARCHS:
            return _pooling_only(arch, requested, is_gguf, is_encoder=True)
        if arch in registry.HEADLESS_ARCHS:
            return _pooling_only(arch, requested, is_gguf, is_encoder=False)
        if arch in registry.MULTIMODAL_ARCHS:
            if requested == "pooling":
                raise ValueError(f"{arch} runs only as a generation model (runner='generate'); pooling over "
                                 "image inputs is not supported.")
            if is_gguf:
                raise ValueError(f"{arch} from a GGUF file is not supported (its vision tower lives in a separate "
                                 "mmproj file); use the model's safetensors folder or Hub id.")
            return ArchitectureChoice(arch, "generate", False)
        if arch in registry.GENERATE_ARCHS:
            if requested != "pooling":
                return ArchitectureChoice(arch, "generate", False)
            headless = registry.HEADLESS_OF.get(arch)
            if headless is None:
                raise ValueError(f"{arch} runs only as a generation model (runner='generate'); the pooling "
                                 f"runner supports {registry.supported_architectures()['pooling']}.")
            return _pooling_only(headless, requested, is_gguf, is_encoder=False)
    raise registry.unsupported_error(archs)


def _pooling_only(arch: str, requested: str, is_gguf: bool, is_encoder: bool) -> ArchitectureChoice:
    if requested == "generate":
        reason = "is an encoder" if is_encoder else "has no LM head"
        raise ValueError(f"{arch} {reason}: it runs only as a pooling model (runner='pooling'), it cannot "
                         f"generate; the generate runner supports {registry.supported_architectures()['generate']}.")
    if is_gguf:
        raise ValueError(f"{arch} from a GGUF file: {GGUF_POOLING}")
    return ArchitectureChoice(arch, "pooling", is_encoder)


def model_resolution(config: EngineConfig, source: ModelSource | None = None) -> ModelResolution:
    """Resolve `config`'s model (files, transformers config, architecture, runner); `source`
    when the caller resolved the files already."""
    source = _source(config, source)
    hf_config = load_hf_config(source)
    archs = registry.architecture_names(getattr(hf_config, "architectures", None),
                                        getattr(hf_config, "model_type", None))
    choice = choose_architecture(archs, config.requested_runner, source.is_gguf)
    if choice.architecture in registry.MULTIMODAL_ARCHS:
        hf_config = text_config_of(hf_config, choice.architecture)
    return ModelResolution(source, hf_config, choice.architecture, choice.runner, choice.is_encoder)


def text_config_of(mm_config: Any, architecture: str) -> Any:
    """A multimodal config as the engine sizes it: its text config (layers, heads, vocabulary,
    positions), carrying the whole config as `multimodal_config` for the model and the front
    end's processing; a text model pagedllm does not run under it is a ValueError."""
    text = mm_config.get_text_config()
    registry.text_architecture(architecture, text)
    text.multimodal_config = mm_config
    for name in ("tie_word_embeddings",):  # kept on the outer config by some checkpoints
        if name in mm_config.to_dict() and name not in text.to_dict():
            setattr(text, name, getattr(mm_config, name))
    return text


def serving_runner(config: EngineConfig) -> Runner:
    """The runner `pagedllm serve` starts, without importing transformers: a folder's
    config.json is read as JSON; a GGUF file (its architecture is in the file, which only the
    engine core parses) generates, and its core checks the architecture."""
    source = _source(config)
    if source.is_gguf:
        return "generate"
    with open(os.path.join(source.path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    archs = raw.get("architectures")
    names = registry.architecture_names(archs if isinstance(archs, list) else None, raw.get("model_type"))
    return choose_architecture(names, config.requested_runner, False).runner


def _source(config: EngineConfig, source: ModelSource | None = None) -> ModelSource:
    """The model's files; a GGUF asked to pool is refused before its metadata is parsed."""
    source = source if source is not None else resolve_model_source(config)
    if source.is_gguf and config.requested_runner == "pooling":
        raise ValueError(f"{source.gguf_file}: {GGUF_POOLING}")
    return source

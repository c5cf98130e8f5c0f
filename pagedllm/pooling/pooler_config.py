"""How a model's hidden states become its output vector: from sentence-transformers' files
when the folder has them (`modules.json`, `1_Pooling/config.json`, `Dense`, `Normalize`,
`config_sentence_transformers.json` prompts, `sentence_bert_config.json`), else the
architecture's default; vLLM's `--pooler-config` JSON overrides either. Whatever this cannot
honour is refused by name, never ignored."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# --pooler-config keys this engine honours (vLLM's PoolerConfig has more: refused by name)
OVERRIDE_KEYS = ("pooling_type", "normalize", "dimensions", "use_activation")
# sentence-transformers module types by their class name (the module path moved in v5 / v6)
_ST_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
_ST_POOLING_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


@dataclass
class DenseLayer:
    """A sentence-transformers `Dense` module: `activation(x @ weight.T + bias)`."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    activation: str  # "identity" | "tanh"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.tanh(y) if self.activation == "tanh" else y


@dataclass
class PoolerConfig:
    pooling_type: str
    normalize: bool
    dimensions: int | None = None  # truncate every embedding to this many values by default
    use_activation: bool = True  # classifiers: softmax (several labels) / sigmoid (one)
    dense: list[DenseLayer] = field(default_factory=list)
    prompt: str = ""  # the default prompt's text, put before every text input
    lowercase: bool = False
    max_seq_length: int | None = None
    source: str = "architecture default"


def default_pooling(is_encoder: bool) -> tuple[str, bool]:
    """vLLM's defaults: an encoder embeds by its [CLS] token, a decoder by its last token; both
    normalised."""
    return ("CLS", True) if is_encoder else ("LAST", True)


def load_pooler_config(model_path: str, is_encoder: bool, override: Any = None) -> PoolerConfig:
    pooling_type, normalize = default_pooling(is_encoder)
    config = PoolerConfig(pooling_type, normalize)
    if os.path.isfile(os.path.join(model_path, "modules.json")):
        config = _from_sentence_transformers(model_path, config)
    if override:
        config = apply_override(config, override)
    return config


def parse_override(override: Any) -> dict[str, Any]:
    """`--pooler-config` as a dict: a JSON object string or a dict; unknown keys named."""
    if isinstance(override, str):
        try:
            override = json.loads(override)
        except json.JSONDecodeError as exc:
            raise ValueError(f"pooler_config is not valid JSON: {exc}") from None
    if not isinstance(override, dict):
        raise ValueError(f"pooler_config must be a JSON object, got {type(override).__name__}.")
    unknown = sorted(set(override) - set(OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"pooler_config keys {unknown} are not supported; supported: {list(OVERRIDE_KEYS)}.")
    pt = override.get("pooling_type")
    if pt is not None and (not isinstance(pt, str) or pt.upper() not in POOLING_TYPES):
        raise ValueError(f"pooler_config pooling_type must be one of {POOLING_TYPES}, got {pt!r}.")
    for key in ("normalize", "use_activation"):
        if key in override and not isinstance(override[key], bool):
            raise ValueError(f"pooler_config {key} must be a boolean, got {override[key]!r}.")
    dims = override.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise ValueError(f"pooler_config dimensions must be a positive integer, got {dims!r}.")
    return override


def apply_override(config: PoolerConfig, override: Any) -> PoolerConfig:
    values = parse_override(override)
    if "pooling_type" in values:
        config.pooling_type = values["pooling_type"].upper()
    for key in ("normalize", "dimensions", "use_activation"):
        if key in values:
            setattr(config, key, values[key])
    config.source += " + --pooler-config"
    return config


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _from_sentence_transformers(model_path: str, config: PoolerConfig) -> PoolerConfig:
    modules = _read_json(os.path.join(model_path, "modules.json"))
    config.source = "sentence-transformers"
    config.normalize = False  # only a Normalize module normalises
    seen_pooling = False
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _ST_MODULES:
            raise ValueError(f"sentence-transformers module {module.get('type')!r} in {model_path}/modules.json "
                             f"is not supported (supported: {list(_ST_MODULES)}).")
        folder = os.path.join(model_path, module.get("path", ""))
        if kind == "Transformer":
            _read_transformer(folder, config)
        elif kind == "Pooling":
            config.pooling_type = _read_pooling(os.path.join(folder, "config.json"))
            seen_pooling = True
        elif kind == "Dense":
            config.dense.append(_read_dense(folder))
        elif kind == "Normalize":
            config.normalize = True
    if not seen_pooling:
        raise ValueError(f"{model_path}/modules.json has no Pooling module; pass --pooler-config.")
    st_path = os.path.join(model_path, "config_sentence_transformers.json")
    if os.path.isfile(st_path):
        st = _read_json(st_path)
        name = st.get("default_prompt_name")
        if name:
            prompts = st.get("prompts") or {}
            if name not in prompts:
                raise ValueError(f"{st_path}: default_prompt_name {name!r} is not among its prompts.")
            config.prompt = prompts[name]
    return config


def _read_transformer(folder: str, config: PoolerConfig) -> None:
    path = os.path.join(folder, "sentence_bert_config.json")
    if os.path.isfile(path):
        cfg = _read_json(path)
        config.max_seq_length = cfg.get("max_seq_length")
        config.lowercase = bool(cfg.get("do_lower_case", False))


def _read_pooling(path: str) -> str:
    cfg = _read_json(path)
    if cfg.get("include_prompt", True) is False:
        raise ValueError(f"{path}: include_prompt=false (prompt tokens left out of the pooling) is not supported.")
    if "pooling_mode" in cfg:  # sentence-transformers >= 5
        modes = [cfg["pooling_mode"]] if isinstance(cfg["pooling_mode"], str) else list(cfg["pooling_mode"])
    else:
        modes = [k[len("pooling_mode_"):].removesuffix("_tokens").removesuffix("_token")
                 for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    if len(modes) != 1 or modes[0] not in _ST_POOLING_MODES:
        raise ValueError(f"{path}: pooling mode {modes} is not supported; supported: "
                         f"{list(_ST_POOLING_MODES)} (one of them).")
    return _ST_POOLING_MODES[modes[0]]


def _read_dense(folder: str) -> DenseLayer:
    cfg = _read_json(os.path.join(folder, "config.json"))
    act = str(cfg.get("activation_function", "torch.nn.modules.activation.Tanh")).rsplit(".", 1)[-1]
    if act not in ("Tanh", "Identity"):
        raise ValueError(f"{folder}: Dense activation {act!r} is not supported (Tanh, Identity).")
    st_file = os.path.join(folder, "model.safetensors")
    if os.path.isfile(st_file):
        from safetensors.torch import load_file

        weights = load_file(st_file)
    else:
        weights = torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    weight = weights["linear.weight"].float()
    if tuple(weight.shape) != (cfg["out_features"], cfg["in_features"]):
        raise ValueError(f"{folder}: Dense weight has shape {tuple(weight.shape)}, config says "
                         f"({cfg['out_features']}, {cfg['in_features']}).")
    bias = weights.get("linear.bias")
    return DenseLayer(weight, None if bias is None else bias.float(), "tanh" if act == "Tanh" else "identity")

"""A PEFT LoRA adapter folder loaded as a `LoRAAdapter`, checked against the model's spec.

A folder holds `adapter_config.json` (peft_config.py) and `adapter_model.safetensors` (or
`adapter_model.bin`, read with `torch.load(weights_only=True)`), whose tensors PEFT names
`base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_A.weight` (`[r, in]`) and
`....lora_B.weight` (`[out, r]`). Every check happens here, once, before an adapter reaches a
slot, and each error names the file, tensor or field: the folder and files exist; what the
config asks for is built; the tensors are exactly those of the modules `target_modules` selects
(none missing, none extra: a layer past the model's, a module it lacks, embeddings, DoRA
magnitudes); each A / B has the model's full in / out features and the module's rank (`r` or
its `rank_pattern` entry), at most `max_lora_rank`; every value is finite.

`base_model_name_or_path` naming another model than the one served is a warning (an adapter
is often trained on a copy of the same weights under another name or path, and the shape checks
catch an adapter of another architecture), an error only with `strict_base_model=True`.

Only local folders are read. A Hugging Face id (`org/name`) is looked up in the local Hub cache
(`snapshot_download(local_files_only=True)`); it is never downloaded here.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError
from safetensors.torch import load_file

from pagedllm.hub import parse_model_id
from pagedllm.lora.adapter import LoRAAdapter, LoRALayerWeights
from pagedllm.lora.model_spec import LoRAModelSpec
from pagedllm.lora.peft_config import PEFTLoRAConfig
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # the first present is read
_NEW_EMBEDDINGS = ("new_embeddings.safetensors", "new_embeddings.bin")
_PEFT_PREFIX = "base_model.model."
_LORA_TENSOR = re.compile(r"model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_(A|B)\.weight")
# what a tensor that is not a decoder projection's A / B is, by a part of its name
_REFUSED_TENSORS = (
    ("lora_embedding_", "LoRA on the embeddings is not supported"),
    ("lora_magnitude_vector", "DoRA magnitudes are not supported"),
    ("lora_B.bias", "a bias on lora_B (lora_bias) is not supported"),
    ("lm_head", "LoRA on the LM head is not supported"),
    ("embed_tokens", "LoRA on the embeddings is not supported"),
)


def load_peft_adapter(request: LoRARequest, spec: LoRAModelSpec, *, max_lora_rank: int = 16,
                      base_model: str | None = None, strict_base_model: bool = False) -> LoRAAdapter:
    """Load and check the adapter `request` names for a model of `spec` (full, unsharded sizes;
    `adapter.shard_adapter` cuts a rank's part). `base_model`: the served model's name or path,
    compared with the adapter's `base_model_name_or_path`."""
    folder = resolve_adapter_dir(request.lora_path, request.lora_name)
    config_path = folder / ADAPTER_CONFIG
    if not config_path.is_file():
        raise ValueError(f"LoRA adapter {request.lora_name!r}: no {ADAPTER_CONFIG} in {folder}")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {request.lora_name!r}: cannot read {config_path}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(raw).__name__}")
    config = PEFTLoRAConfig.from_dict(raw, str(config_path))
    _check_base_model(config.base_model_name_or_path, base_model, config_path, strict_base_model)
    for name in _NEW_EMBEDDINGS:
        if (folder / name).exists():
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {folder / name}: added tokens (extra "
                             "vocabulary embeddings) are not supported")
    targets = config.targets(spec, str(config_path))
    for key in targets.values():
        if config.rank_of(key) > max_lora_rank:
            raise ValueError(f"{config_path}: rank {config.rank_of(key)} of {key} is greater than "
                             f"max_lora_rank={max_lora_rank}")
    weights_path, tensors = _read_tensors(folder, request.lora_name)
    by_module = _group_tensors(tensors, targets, spec, weights_path)
    weights: dict[tuple[int, str], LoRALayerWeights] = {}
    for (layer, module), key in targets.items():
        a, b = _checked_pair(by_module.get((layer, module), {}), key, module, config.rank_of(key), spec, weights_path)
        scaling = config.scaling_of(key)
        b = b * scaling
        parts = spec.checkpoint_modules[module]
        for part, rows in zip(parts, b.split(spec.checkpoint_out_features(module), dim=0)):
            weights[layer, part] = LoRALayerWeights(a, rows, scaling)  # rows: a view, contiguous
    rank = max(w.rank for w in weights.values())
    return LoRAAdapter(request.lora_name, request.lora_int_id, rank, config.scaling, weights)


def resolve_adapter_dir(path: str, name: str = "") -> Path:
    """The adapter's local folder: `path` itself, or a Hub id's snapshot in the local HF cache."""
    what = f"LoRA adapter {name!r}" if name else "LoRA adapter"
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists():
        raise ValueError(f"{what}: {path} is a file; give the adapter's folder (with {ADAPTER_CONFIG})")

    hub_id = parse_model_id(path)
    if hub_id is None or hub_id.quant_tag is not None:
        raise ValueError(f"{what}: folder {path} does not exist")

    try:
        return Path(snapshot_download(hub_id.repo_id, local_files_only=True,
                                      allow_patterns=[ADAPTER_CONFIG, *ADAPTER_WEIGHTS]))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
        raise ValueError(f"{what}: {path!r} is neither a local folder nor in the local Hugging Face cache "
                         f"(adapters are never downloaded by the server: fetch it first, e.g. `hf download {path}`, "
                         f"or give its folder): {type(e).__name__}") from None


def _check_base_model(adapter_base: str | None, served: str | None, where: Path, strict: bool) -> None:
    if not adapter_base or not served or _same_model(adapter_base, served):
        return
    message = (f"{where}: base_model_name_or_path={adapter_base!r} is not the served model {served!r}; the adapter "
               "may have been trained on other weights")
    if strict:
        raise ValueError(message)
    logger.warning("%s", message)


def _same_model(a: str, b: str) -> bool:
    """Equal ids / paths, or the same last path component (`org/Name` served from `/models/name`)."""
    a, b = a.rstrip("/\\").replace("\\", "/"), b.rstrip("/\\").replace("\\", "/")
    return a == b or a.rsplit("/", 1)[-1].lower() == b.rsplit("/", 1)[-1].lower()


def _read_tensors(folder: Path, name: str) -> tuple[Path, dict[str, torch.Tensor]]:
    for file_name in ADAPTER_WEIGHTS:
        path = folder / file_name
        if not path.is_file():
            continue
        try:
            if path.suffix == ".safetensors":
                tensors = load_file(str(path), device="cpu")
            else:
                tensors = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a corrupt file: the reader's own error, with the file named
            raise ValueError(f"LoRA adapter {name!r}: cannot read {path}: {e}") from None
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise ValueError(f"{path}: expected a mapping of tensor names to tensors")
        return path, tensors
    raise ValueError(f"LoRA adapter {name!r}: no {' or '.join(ADAPTER_WEIGHTS)} in {folder}")


def _group_tensors(tensors: dict[str, torch.Tensor], targets: dict[tuple[int, str], str], spec: LoRAModelSpec,
                   where: Path) -> dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]]:
    """`(layer, module) -> {"A" | "B": (tensor name, tensor)}`; ValueError for any tensor that is
    not the A / B of a module the config targets."""
    grouped: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        short = name.removeprefix(_PEFT_PREFIX)
        match = _LORA_TENSOR.fullmatch(short)
        if match is None:
            reason = next((why for part, why in _REFUSED_TENSORS if part in name),
                          "not the lora_A / lora_B weight of a decoder layer's projection")
            raise ValueError(f"{where}: tensor {name}: {reason}")
        layer, block, module = int(match[1]), match[2], match[3]
        if layer >= spec.num_layers:
            raise ValueError(f"{where}: tensor {name}: layer index {layer} is past the model's "
                             f"{spec.num_layers} layers ({spec.architecture})")
        parts = spec.checkpoint_modules.get(module)
        if parts is None or spec.modules[parts[0]].block != block:
            raise ValueError(f"{where}: tensor {name}: {block}.{module} is not a LoRA module of {spec.architecture} "
                             f"(its modules: {sorted(spec.checkpoint_modules)})")
        if (layer, module) not in targets:
            raise ValueError(f"{where}: tensor {name}: module {short.rsplit('.lora_', 1)[0]} is not selected by "
                             "the config's target_modules")
        grouped.setdefault((layer, module), {})[match[4]] = (name, tensor)
    return grouped


def _checked_pair(pair: dict[str, tuple[str, torch.Tensor]], key: str, module: str, rank: int,
                  spec: LoRAModelSpec, where: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """A `[rank, in]`, B `[out, rank]` of module `key` as float32, after the shape and value checks."""
    in_features = spec.modules[spec.checkpoint_modules[module][0]].in_features
    out_features = sum(spec.checkpoint_out_features(module))
    expected = {"A": (rank, in_features), "B": (out_features, rank)}
    checked = []
    for which in ("A", "B"):
        if which not in pair:
            raise ValueError(f"{where}: missing tensor {_PEFT_PREFIX}{key}.lora_{which}.weight "
                             "(the config targets that module)")
        name, tensor = pair[which]
        if tuple(tensor.shape) != expected[which]:
            layout = "[r, in_features]" if which == "A" else "[out_features, r]"
            raise ValueError(f"{where}: tensor {name} has shape {tuple(tensor.shape)}, expected {expected[which]} "
                             f"({layout} of {spec.architecture}'s {module} with r={rank})")
        if not tensor.is_floating_point():
            raise ValueError(f"{where}: tensor {name} has dtype {tensor.dtype}, expected a floating-point type")
        tensor = tensor.to(torch.float32)
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{where}: tensor {name} has non-finite values (nan or inf)")
        checked.append(tensor)
    return checked[0], checked[1]

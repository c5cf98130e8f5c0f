"""Build a model from a transformers folder (safetensors) or a GGUF file and load its weights."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pagedllm import envs
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.quantization.config_detection import get_quantization_config
from pagedllm.model.gguf_loader import iter_gguf_weights, resolve_gguf_path
from pagedllm.model.registry import get_model_class

logger = logging.getLogger(__name__)


def safetensors_files(model_path: str) -> list[str]:
    """The checkpoint's safetensors files (from the shard index when there is one)."""
    if not os.path.isdir(model_path):
        raise ValueError(f"Model path {model_path!r} is not a folder (and no GGUF file was given)")
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_path, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"No *.safetensors weights found in {model_path!r}")
    return files


def iter_safetensors_weights(model_path: str, slices_of=None) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` of every checkpoint tensor; with `slices_of(name, shape) -> cuts` (a
    tensor-parallel model's `checkpoint_slices`) only this rank's part of each is read."""
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if slices_of is None:
                    yield name, f.get_tensor(name)
                    continue
                part = f.get_slice(name)
                shape = tuple(part.get_shape())
                cuts = slices_of(name, shape)
                if not cuts:
                    yield name, f.get_tensor(name)
                    continue
                index = [slice(None)] * len(shape)
                for dim, start, length in cuts:
                    if start < 0 or start + length > shape[dim]:
                        raise ValueError(f"Checkpoint tensor {name} has shape {shape}: this rank's part "
                                         f"{start}..{start + length - 1} of dimension {dim} is out of range")
                    index[dim] = slice(start, start + length)
                yield name, part[tuple(index)]


def load_model(
    model_path: str,
    gguf_file: str | None,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: str | None = None,
    quant_compute: str = "auto",
    tp: TensorParallelGroup | None = None,
) -> nn.Module:
    """The model for `hf_config` with its weights, in `dtype` on `device`, in eval mode.

    `gguf_file` (a path, absolute or relative to `model_path`) selects a llama.cpp GGUF file,
    dequantized to `dtype`; otherwise `model_path` is a transformers folder of safetensors.
    `model_path` may also be the path of a `.gguf` file itself.
    A folder whose config.json has a `quantization_config` (GPTQ, AWQ, compressed-tensors) gets
    quantized linear layers (quantization/); `quantization` (the user's knob), when
    given, must name the same method (ValueError otherwise); `quant_compute` picks their CPU
    arithmetic (exact / int8 / auto).
    `tp` (a tensor-parallel group of more than one rank): the model of this rank's shard, and
    only that part of each checkpoint tensor is read (the model's `checkpoint_slices`).
    """
    model_cls = get_model_class(hf_config)
    device = torch.device(device)
    gguf_path = resolve_gguf_path(model_path, gguf_file)
    quant_config = get_quantization_config(hf_config, quantization, is_gguf=gguf_path is not None,
                                          compute=quant_compute)
    kwargs: dict[str, Any] = {}
    if quant_config is not None:
        kwargs["quant_config"] = quant_config
    if tp is not None and tp.world_size > 1:
        kwargs["tp"] = tp
    model = model_cls(hf_config, dtype=dtype, device=device, **kwargs)
    slices_of = model.checkpoint_slices if "tp" in kwargs else None
    if gguf_path is not None:
        # Q4_0 / Q4_1 / Q8_0 matrices stay packed (quantization/gguf.py); with
        # PAGEDLLM_GGUF_BLOCKS=0 they are dequantized to float32 as before (for A/B checks).
        keep = envs.PAGEDLLM_GGUF_BLOCKS
        weights = iter_gguf_weights(gguf_path, hf_config, keep_blocks=keep, slices_of=slices_of)
    else:
        weights = iter_safetensors_weights(model_path, slices_of)
    model.load_weights(weights)
    model.process_weights_after_loading()  # quantized forms, the C kernels' forms: now, not in the first request
    breakdown = weight_memory(model)
    file_note = f" (file: {os.path.getsize(gguf_path) / 2**20:.1f} MiB)" if gguf_path is not None else ""
    logger.info("Weights: %.1f MiB%s = %s", sum(breakdown.values()) / 2**20, file_note,
                ", ".join(f"{name} {n / 2**20:.1f} MiB" for name, n in breakdown.items() if n))
    return model.eval()


def weight_memory(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's weights by form: GGUF blocks read in place (gguf_gemm.c), integer
    weights repacked for int_gemm.c, and float tensors (norms, biases, float matrices, and any
    packed matrix that had to be widened, which the loader warned about by name)."""
    seen: set[int] = set()
    out = {"GGUF blocks in place": 0, "int_gemm repacked": 0, "float": 0}

    def add(kind: str, t: torch.Tensor) -> None:
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[kind] += t.numel() * t.element_size()

    for module in model.modules():
        for part in getattr(module, "gguf_weights", None) or []:
            add("GGUF blocks in place", part.data)
        gguf_weight = getattr(module, "gguf_weight", None)
        if gguf_weight is not None:
            add("GGUF blocks in place", gguf_weight.data)
        int_weight = getattr(module, "int_weight", None)
        if int_weight is not None and hasattr(int_weight, "data"):
            add("int_gemm repacked", int_weight.data)
            if getattr(int_weight, "float_weight", None) is not None:
                add("float", int_weight.float_weight)
        for p in module.parameters(recurse=False):
            if p is not None:
                add("float", p)
    return out

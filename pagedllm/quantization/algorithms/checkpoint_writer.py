"""`pagedllm quantize`: write a quantized checkpoint folder (GPTQ, AWQ or compressed-tensors
layout) from a float model, so that tests and benchmarks own their quantized fixtures.

Methods (`pagedllm/quantization/algorithms/`):
- `rtn`: round to nearest per group of `group_size` input columns and output row (asymmetric
  min/max or symmetric absmax, the scale rounded to float16 before the codes are chosen, so the
  written checkpoint dequantizes exactly to what was intended). With `act_order` (GPTQ format)
  the columns are ordered by descending norm of the weights reading that input (a
  calibration-free stand-in for GPTQ's Hessian order) before groups are formed; it produces
  real act-order checkpoints for the loader, not better quality.
- `gptq`: GPTQ's Hessian-based error compensation, layer by layer on calibration samples;
  `act_order` orders the columns by the Hessian's diagonal.
- `awq`: AWQ's activation-aware scale search (and clipping search), the scales folded into the
  norms / preceding projections, then round to nearest.
`gptq` and `awq` read calibration samples: `num_samples` windows of `seq_len` tokens of the
shipped calibration text (`pagedllm/data/calibration.txt`) or of a given file.

Only the decoder's projections (q/k/v/o, gate/up/down) are quantized; embeddings and the LM head
are written as they are in the source, the norms too except where AWQ folded scales into them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig

from pagedllm.model.gguf_loader import iter_gguf_weights
from pagedllm.model.loader import iter_safetensors_weights
from pagedllm.model_source import load_hf_config, resolve_model
from pagedllm.quantization.algorithms import pipeline
from pagedllm.quantization.algorithms.calibration import calibration_samples, read_text
from pagedllm.quantization.formats.packing import pack_awq, pack_int32
from pagedllm.quantization.algorithms.gptq import QuantizedWeight
from pagedllm.quantization.algorithms.grid import rtn_quantize
from pagedllm.tokenizer import load_tokenizer

__all__ = ["quantize_model", "quantize_tensors", "rtn_quantize", "METHODS", "FORMATS"]

logger = logging.getLogger(__name__)

METHODS = ("rtn", "gptq", "awq")
FORMATS = ("gptq", "awq", "compressed-tensors")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SAME_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _act_order_perms(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """RTN's act-order: per projection, the column order (descending norm over the weights
    reading its input)."""
    by_input: dict[str, list[str]] = {}
    for name in weights:
        parent, _, proj = name.rpartition(".")
        key = parent + "." + _SAME_INPUT.get(proj, proj)
        by_input.setdefault(key, []).append(name)
    perms = {}
    for names in by_input.values():
        norms = torch.cat([weights[n] for n in names]).float().norm(dim=0)
        perm = torch.argsort(norms, descending=True, stable=True)
        perms.update({n: perm for n in names})
    return perms


def rtn_weights(weights: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool, act_order: bool = False,
                min_zero: int = 0) -> dict[str, QuantizedWeight]:
    """Round to nearest of every `{module name: W [out, in]}`."""
    perms = _act_order_perms(weights) if act_order else {}
    out = {}
    for name, w in weights.items():
        k = w.shape[1]
        gs = k if group_size == -1 else group_size
        perm = perms.get(name)
        codes, scales, zeros = rtn_quantize(w if perm is None else w[:, perm], bits, group_size, sym, min_zero)
        g_idx = torch.arange(k, dtype=torch.int32) // gs
        if perm is not None:  # back to the checkpoint's column order; g_idx says each column's group
            codes = torch.empty_like(codes).index_copy_(1, perm, codes)
            g_idx = torch.empty_like(g_idx).index_copy_(0, perm, g_idx)
        out[name] = QuantizedWeight(codes, scales, zeros, g_idx)
    return out


def pack_weights(results: dict[str, QuantizedWeight], fmt: str, bits: int, sym: bool,
                 checkpoint_format: str = "gptq", activations: str | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of `fmt` for quantized weights `{module name: QuantizedWeight}`
    (`activations="int8"`: compressed-tensors int-quantized W8A8)."""
    out: dict[str, torch.Tensor] = {}
    for name, q in results.items():
        n, k = q.codes.shape
        codes, scales, zeros = q.codes, q.scales, q.zeros
        if activations == "int8":  # int8 weights, symmetric per channel: zero 128 on unsigned codes
            out[f"{name}.weight"] = (codes.to(torch.int32) - 128).to(torch.int8).contiguous()
            out[f"{name}.weight_scale"] = scales.contiguous()
            continue
        trivial = bool(torch.equal(q.g_idx, torch.arange(k, dtype=torch.int32) // (k // scales.shape[1])))
        if fmt != "gptq" and not trivial:
            raise ValueError(f"{name}: act-order (a g_idx) is only written in the gptq format")
        if fmt == "gptq":
            if checkpoint_format == "gptq" and int(zeros.min()) < 1:
                raise ValueError(f"{name}: a zero point of 0 cannot be stored in gptq v1 (use gptq_v2)")
            stored = zeros - 1 if checkpoint_format == "gptq" else zeros
            out[f"{name}.qweight"] = pack_int32(codes.t(), bits, dim=0)
            out[f"{name}.qzeros"] = pack_int32(stored.t(), bits, dim=1)
            out[f"{name}.scales"] = scales.t().contiguous()
            out[f"{name}.g_idx"] = q.g_idx.to(torch.int32).clone()
        elif fmt == "awq":
            out[f"{name}.qweight"] = pack_awq(codes.t().contiguous())
            out[f"{name}.qzeros"] = pack_awq(zeros.t().contiguous())
            out[f"{name}.scales"] = scales.t().contiguous()
        else:
            out[f"{name}.weight_packed"] = pack_int32(codes, bits, dim=1)
            out[f"{name}.weight_scale"] = scales.contiguous()
            out[f"{name}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            if not sym:
                out[f"{name}.weight_zero_point"] = pack_int32(zeros, bits, dim=0)
    return out


def quantize_tensors(weights: dict[str, torch.Tensor], fmt: str, bits: int, group_size: int, sym: bool,
                     act_order: bool = False, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """The checkpoint tensors of `fmt` for `weights` (`{module name: W [out, in]}`), by RTN."""
    min_zero = 1 if fmt == "gptq" and checkpoint_format == "gptq" else 0
    return pack_weights(rtn_weights(weights, bits, group_size, sym, act_order, min_zero), fmt, bits, sym,
                        checkpoint_format)


def quantization_config(fmt: str, bits: int, group_size: int, sym: bool, act_order: bool,
                        checkpoint_format: str, method: str = "rtn", damp_percent: float = 0.01,
                        activations: str | None = None) -> dict[str, Any]:
    if fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
              "sym": sym, "checkpoint_format": checkpoint_format, "static_groups": False,
              "true_sequential": True, "lm_head": False, "meta": {"quantizer": [f"pagedllm:{method}"]}}
        if method == "gptq":
            qc["damp_percent"] = damp_percent
        return qc
    if fmt == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False, "actorder": None,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size,
               "observer": "minmax" if method == "rtn" else method}
    if activations == "int8":
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
        return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                              "output_activations": None, "format": "int-quantized"}},
                "ignore": ["lm_head"], "kv_cache_scheme": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def _source(model: str | None):
    """(config, weight iterator, a function that writes the tokenizer files into a folder,
    a function that loads the tokenizer)."""
    src = resolve_model(model)
    hf_config = load_hf_config(src)
    if src.is_gguf:
        def write_tokenizer(dst: Path) -> None:
            load_tokenizer(src.path, src.gguf_file).save_pretrained(dst)

        return (hf_config, iter_gguf_weights(os.path.join(src.path, src.gguf_file), hf_config), write_tokenizer,
                lambda: load_tokenizer(src.path, src.gguf_file))

    def copy_files(dst: Path) -> None:
        for f in Path(src.path).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                    "config.json", "model.safetensors.index.json"):
                shutil.copy2(f, dst / f.name)

    return hf_config, iter_safetensors_weights(src.path), copy_files, lambda: load_tokenizer(src.path)


def quantize_model(model: str | None, out: str, method: str = "rtn", bits: int = 4, group_size: int = 64,
                   fmt: str = "gptq", sym: bool | None = None, act_order: bool = False,
                   checkpoint_format: str = "gptq", calibration: str | None = None, num_samples: int | None = None,
                   seq_len: int = 512, damp_percent: float = 0.01, awq_clip: bool = True,
                   awq_search_samples: int = 8, batch_size: int = 8, activations: str | None = None) -> Path:
    """Write the quantized checkpoint folder `out` from `model` (an HF folder, a .gguf file, or
    None for the default SmolLM2). Returns the folder.

    `calibration` (gptq, awq): a text file, or None for the shipped calibration text;
    `num_samples` windows of `seq_len` tokens of it (None: as many non-overlapping windows as
    the text holds, at most 128; the shipped text holds 122 of 512 SmolLM2 tokens). `damp_percent`: GPTQ's dampening (of the
    Hessian's mean diagonal). `awq_clip`: AWQ's clipping search; `awq_search_samples`: how many
    of the samples AWQ's searches evaluate on (its mean |x| reads all)."""
    if method not in METHODS:
        raise ValueError(f"--method must be one of {list(METHODS)}, got {method!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {list(FORMATS)}, got {fmt!r}")
    if bits not in (4, 8) or (fmt == "awq" and bits != 4):
        raise ValueError(f"--bits {bits} is not supported for --format {fmt} (gptq, compressed-tensors: 4 or 8; "
                         "awq: 4)")
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"--group-size must be -1 (per channel) or positive, got {group_size}")
    if act_order and fmt != "gptq":
        raise ValueError("--act-order is only written in the gptq format")
    if act_order and method == "awq":
        raise ValueError("--act-order is a GPTQ / RTN column order; AWQ does not use it")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"--checkpoint-format must be gptq or gptq_v2, got {checkpoint_format!r}")
    if method != "rtn" and ((num_samples is not None and num_samples < 1) or seq_len < 2):
        raise ValueError(f"--num-samples must be >= 1 and --seq-len >= 2, got {num_samples} and {seq_len}")
    if activations not in (None, "int8"):
        raise ValueError(f"--activations must be int8 (or absent), got {activations!r}")
    if activations == "int8" and (fmt != "compressed-tensors" or bits != 8 or group_size != -1 or sym is False):
        raise ValueError("--activations int8 (W8A8) is written as compressed-tensors int-quantized: "
                         "--format compressed-tensors --bits 8 --group-size -1, symmetric")
    if sym is None:
        sym = fmt != "awq"  # AutoGPTQ's and llm-compressor's W4A16 default; AWQ is asymmetric
    out_path = Path(out)
    if out_path.exists() and any(out_path.iterdir()):
        raise ValueError(f"--out {out!r} exists and is not empty")

    hf_config, weights, write_tokenizer, tokenizer = _source(model)
    if getattr(hf_config, "quantization_config", None) is not None:
        raise ValueError(f"{model!r} is already a quantized checkpoint")
    tensors: dict[str, torch.Tensor] = {}
    projections: dict[str, torch.Tensor] = {}
    for name, t in weights:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in PROJECTIONS and module.startswith("model.layers."):
            if group_size != -1 and t.shape[1] % group_size:
                raise ValueError(f"--group-size {group_size} does not divide the input size {t.shape[1]} of {name} "
                                 "(SmolLM2's 576 = 4.5 x 128: use 64 or 32)")
            projections[module] = t
        else:
            tensors[name] = t.contiguous()
    if not projections:
        raise ValueError(f"{model!r} has no decoder projections to quantize")
    min_zero = 1 if fmt == "gptq" and checkpoint_format == "gptq" else 0
    if method == "rtn":
        results = rtn_weights(projections, bits, group_size, sym, act_order, min_zero)
    else:
        t0 = time.perf_counter()
        samples = calibration_samples(tokenizer(), read_text(calibration), num_samples, seq_len)
        grid = pipeline.Grid(bits, group_size, sym, min_zero)
        everything = {**tensors, **{m + ".weight": w for m, w in projections.items()}}
        if method == "gptq":
            results = pipeline.gptq_model(everything, hf_config, samples, grid, act_order, damp_percent,
                                          batch_size=batch_size)
        else:
            pipeline.awq_model(everything, hf_config, samples, grid, clip=awq_clip,
                               search_samples=awq_search_samples, batch_size=batch_size)
            tensors.update({n: everything[n] for n in tensors})  # the norms AWQ scaled
            results = rtn_weights({m: everything[m + ".weight"] for m in projections}, bits, group_size, sym,
                                  min_zero=min_zero)
        logger.info("%s on %d x %d calibration tokens: %.1f s", method, *samples.shape, time.perf_counter() - t0)
    tensors.update(pack_weights(results, fmt, bits, sym, checkpoint_format, activations))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_path.name + ".", dir=out_path.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = hf_config.to_dict()
        config.pop("quantization_config", None)
        if not config.get("architectures"):
            config["architectures"] = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                        "qwen2": "Qwen2ForCausalLM"}.get(config.get("model_type"), "LlamaForCausalLM")]
        config["quantization_config"] = quantization_config(fmt, bits, group_size, sym, act_order, checkpoint_format,
                                                            method, damp_percent, activations=activations)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        write_tokenizer(tmp)
        if not (tmp / "generation_config.json").exists():
            GenerationConfig.from_model_config(hf_config).save_pretrained(tmp)
        if out_path.exists():
            out_path.rmdir()
        os.replace(tmp, out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_path

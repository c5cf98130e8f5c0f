"""`pagedllm quantize`: write a quantized checkpoint folder (GPTQ, AWQ or compressed-tensors
layout) from a float model, so that tests and benchmarks own their quantized fixtures.

Method: `rtn` (round to nearest, per group of `group_size` input columns, per output row;
asymmetric min/max or symmetric absmax, the scale rounded to float16 before the codes are
chosen, so the written checkpoint dequantizes exactly to what was intended). GPTQ's Hessian
error compensation and AWQ's activation-aware scales (`--method gptq|awq`) are not implemented
yet and are refused by name. `act_order` (GPTQ format only) orders each layer's input columns
by descending column norm of the weights that read that input (a calibration-free stand-in for
GPTQ's Hessian diagonal) before forming groups, and writes the resulting `g_idx`: it exists to
produce real act-order checkpoints for the loader, not better quality.

Only the decoder's projections (q/k/v/o, gate/up/down) are quantized; embeddings, norms and the
LM head are written as they are in the source.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from pagedllm.layers.quantization.packing import pack_awq, pack_int32

METHODS = ("rtn",)
NOT_YET = {"gptq": "GPTQ's Hessian-based error compensation", "awq": "AWQ's activation-aware scale search"}
FORMATS = ("gptq", "awq", "compressed-tensors")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SAME_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool, min_zero: int = 0):
    """Round-to-nearest of `w [out, in]` in groups along the input: unsigned codes int32
    `[out, in]`, float16 scales `[out, groups]`, int32 zero points `[out, groups]`, with
    `W ~= (code - zero) * scale`."""
    out, k = w.shape
    gs = k if group_size == -1 else group_size
    if k % gs:
        raise ValueError(f"group size {group_size} does not divide the input size {k}")
    g = w.detach().to(torch.float32).reshape(out, k // gs, gs)
    maxq = (1 << bits) - 1
    if sym:
        scale = 2 * g.abs().amax(-1) / maxq
        zero = torch.full(scale.shape, float(1 << (bits - 1)))
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = (hi - lo) / maxq
        zero = torch.round(-lo / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp(min_zero, maxq)
    scale = scale.clamp(min=2.0**-14).to(torch.float16)  # no zero / subnormal scales
    codes = torch.round(g / scale.float().unsqueeze(-1)) + zero.unsqueeze(-1)
    codes = codes.clamp(0, maxq).to(torch.int32).reshape(out, k)
    return codes, scale, zero.to(torch.int32)


def _act_order_perms(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per projection, the column order (descending norm over the weights reading its input)."""
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


def quantize_tensors(weights: dict[str, torch.Tensor], fmt: str, bits: int, group_size: int, sym: bool,
                     act_order: bool = False, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """The checkpoint tensors of `fmt` for `weights` (`{module name: W [out, in]}`)."""
    perms = _act_order_perms(weights) if act_order else {}
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        n, k = w.shape
        perm = perms.get(name)
        wp = w if perm is None else w[:, perm]
        codes, scales, zeros = rtn_quantize(wp, bits, group_size, sym,
                                            min_zero=1 if fmt == "gptq" and checkpoint_format == "gptq" else 0)
        if perm is not None:  # back to the checkpoint's column order; g_idx says each column's group
            codes = torch.empty_like(codes).index_copy_(1, perm, codes)
            gs = k if group_size == -1 else group_size
            g_idx = torch.empty(k, dtype=torch.int32).index_copy_(0, perm, torch.arange(k, dtype=torch.int32) // gs)
        else:
            g_idx = torch.arange(k, dtype=torch.int32) // (k if group_size == -1 else group_size)
        if fmt == "gptq":
            stored = zeros - 1 if checkpoint_format == "gptq" else zeros
            out[f"{name}.qweight"] = pack_int32(codes.t(), bits, dim=0)
            out[f"{name}.qzeros"] = pack_int32(stored.t(), bits, dim=1)
            out[f"{name}.scales"] = scales.t().contiguous()
            out[f"{name}.g_idx"] = g_idx
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


def quantization_config(fmt: str, bits: int, group_size: int, sym: bool, act_order: bool,
                        checkpoint_format: str) -> dict[str, Any]:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
                "sym": sym, "checkpoint_format": checkpoint_format, "static_groups": False,
                "true_sequential": True, "lm_head": False, "meta": {"quantizer": ["pagedllm:rtn"]}}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False, "actorder": None,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def _source(model: str | None):
    """(config dict, weight iterator, a function that writes the tokenizer files into a folder)."""
    from pagedllm.model.gguf_loader import iter_gguf_weights
    from pagedllm.model.loader import iter_safetensors_weights
    from pagedllm.model_source import load_hf_config, resolve_model

    src = resolve_model(model)
    hf_config = load_hf_config(src)
    if src.is_gguf:
        def write_tokenizer(dst: Path) -> None:
            from pagedllm.tokenizer import load_tokenizer

            load_tokenizer(src.path, src.gguf_file).save_pretrained(dst)

        return hf_config, iter_gguf_weights(os.path.join(src.path, src.gguf_file), hf_config), write_tokenizer

    def copy_files(dst: Path) -> None:
        for f in Path(src.path).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                    "config.json", "model.safetensors.index.json"):
                shutil.copy2(f, dst / f.name)

    return hf_config, iter_safetensors_weights(src.path), copy_files


def quantize_model(model: str | None, out: str, method: str = "rtn", bits: int = 4, group_size: int = 64,
                   fmt: str = "gptq", sym: bool | None = None, act_order: bool = False,
                   checkpoint_format: str = "gptq") -> Path:
    """Write the quantized checkpoint folder `out` from `model` (an HF folder, a .gguf file, or
    None for the default SmolLM2). Returns the folder."""
    if method in NOT_YET:
        raise ValueError(f"--method {method} ({NOT_YET[method]}) is not implemented yet; use --method rtn")
    if method not in METHODS:
        raise ValueError(f"--method must be one of {list(METHODS) + list(NOT_YET)}, got {method!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {list(FORMATS)}, got {fmt!r}")
    if bits not in (4, 8) or (fmt == "awq" and bits != 4):
        raise ValueError(f"--bits {bits} is not supported for --format {fmt} (gptq, compressed-tensors: 4 or 8; "
                         "awq: 4)")
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"--group-size must be -1 (per channel) or positive, got {group_size}")
    if act_order and fmt != "gptq":
        raise ValueError("--act-order is only written in the gptq format")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"--checkpoint-format must be gptq or gptq_v2, got {checkpoint_format!r}")
    if sym is None:
        sym = fmt != "awq"  # AutoGPTQ's and llm-compressor's W4A16 default; AWQ is asymmetric
    out_path = Path(out)
    if out_path.exists() and any(out_path.iterdir()):
        raise ValueError(f"--out {out!r} exists and is not empty")
    from safetensors.torch import save_file

    hf_config, weights, write_tokenizer = _source(model)
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
    tensors.update(quantize_tensors(projections, fmt, bits, group_size, sym, act_order, checkpoint_format))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_path.name + ".", dir=out_path.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = hf_config.to_dict()
        config.pop("quantization_config", None)
        if not config.get("architectures"):
            config["architectures"] = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                        "qwen2": "Qwen2ForCausalLM"}.get(config.get("model_type"), "LlamaForCausalLM")]
        config["quantization_config"] = quantization_config(fmt, bits, group_size, sym, act_order, checkpoint_format)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        write_tokenizer(tmp)
        if not (tmp / "generation_config.json").exists():
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(hf_config).save_pretrained(tmp)
        if out_path.exists():
            out_path.rmdir()
        os.replace(tmp, out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_path

"""Layer-by-layer calibrated quantization of a Llama-family model's float weights.

Both drivers embed the calibration samples, then walk the decoder layers in order, each layer
fed the hidden states that the previous layers produced, in batches of `batch_size` sequences.

GPTQ (as GPTQModel with `true_sequential`): inside a layer, one forward in four pieces, each
piece's inputs computed with the pieces before it already quantized: q/k/v (one Hessian, the
shared normed input), o_proj, gate/up (one Hessian), down_proj. The next layer reads this
layer's quantized output. Returns each projection's `QuantizedWeight`.

AWQ (as AutoAWQ): one float forward of the layer over all samples collects each group's mean
|x| and the next layer's input (the float output, as AutoAWQ); the scale search and the clip
search evaluate on `search_samples` of the sequences (the CPU's budget: AutoAWQ uses all of
them on a GPU). Groups, in order: q/k/v after input_layernorm, o_proj after v_proj (only when
v_proj's output size equals o_proj's input, i.e. no grouped-query attention, as AutoAWQ),
gate/up after post_attention_layernorm, down_proj after up_proj. The scales are folded into
the weights dict in place (norm weights included); the caller then rounds the projections to
nearest on the grid.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.quantization.algorithms import awq
from pagedllm.quantization.algorithms.block import (
    BlockShape, Rope, attention_core, full_name, layer_weights, linear, mlp, mlp_act, rms_norm, self_attn)
from pagedllm.quantization.algorithms.gptq import QuantizedWeight, accumulate_hessian, gptq_quantize
from pagedllm.quantization.algorithms.grid import fake_quantize

logger = logging.getLogger(__name__)

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class Grid:
    bits: int
    group_size: int
    sym: bool
    min_zero: int = 0

    def fake(self, w: torch.Tensor) -> torch.Tensor:
        return fake_quantize(w, self.bits, self.group_size, self.sym, self.min_zero)


def _num_layers(hf_config: Any) -> int:
    return int(hf_config.num_hidden_layers)


def _embed(weights: dict[str, torch.Tensor], samples: torch.Tensor) -> torch.Tensor:
    return weights["model.embed_tokens.weight"].to(torch.float32)[samples]


@torch.no_grad()
def gptq_model(weights: dict[str, torch.Tensor], hf_config: Any, samples: torch.Tensor, grid: Grid,
               act_order: bool = False, damp_percent: float = 0.01, block_size: int = 128, batch_size: int = 8,
               ) -> dict[str, QuantizedWeight]:
    shape, rope = BlockShape.from_config(hf_config), Rope(hf_config)
    hidden = list(_embed(weights, samples).split(batch_size))
    n_tokens = samples.numel()
    results: dict[str, QuantizedWeight] = {}
    for i in range(_num_layers(hf_config)):
        t0 = time.perf_counter()
        w = layer_weights(weights, i)

        def quantize(names: tuple[str, ...], xtx: torch.Tensor) -> None:
            H = (2.0 / n_tokens) * xtx
            stacked = torch.cat([w[n + ".weight"] for n in names])
            q = gptq_quantize(stacked, H.to(torch.float32), grid.bits, grid.group_size, grid.sym, act_order,
                              damp_percent, block_size, grid.min_zero)
            row = 0
            for n in names:
                rows = w[n + ".weight"].shape[0]
                part = QuantizedWeight(q.codes[row:row + rows].clone(), q.scales[row:row + rows].clone(),
                                       q.zeros[row:row + rows].clone(),
                                       q.g_idx)
                results[full_name(i, n)] = part
                w[n + ".weight"] = part.dequantize()
                row += rows

        eps = shape.eps
        xtx = None
        for h in hidden:
            xtx = accumulate_hessian(xtx, rms_norm(h, w["input_layernorm.weight"], eps))
        quantize(QKV, xtx)
        attn, xtx = [], None
        for h in hidden:
            attn.append(attention_core(rms_norm(h, w["input_layernorm.weight"], eps), w, shape, rope))
            xtx = accumulate_hessian(xtx, attn[-1])
        quantize(("o_proj",), xtx)
        hidden = [h + linear(a, w, "o_proj") for h, a in zip(hidden, attn)]
        del attn
        xtx = None
        for h in hidden:
            xtx = accumulate_hessian(xtx, rms_norm(h, w["post_attention_layernorm.weight"], eps))
        quantize(GATE_UP, xtx)
        acts, xtx = [], None
        for h in hidden:
            acts.append(mlp_act(rms_norm(h, w["post_attention_layernorm.weight"], eps), w))
            xtx = accumulate_hessian(xtx, acts[-1])
        quantize(("down_proj",), xtx)
        hidden = [h + linear(a, w, "down_proj") for h, a in zip(hidden, acts)]
        del acts
        logger.info("gptq: layer %d quantized in %.1f s", i, time.perf_counter() - t0)
    return results


@torch.no_grad()
def awq_model(weights: dict[str, torch.Tensor], hf_config: Any, samples: torch.Tensor, grid: Grid,
              n_grid: int = 20, clip: bool = True, search_samples: int = 8, batch_size: int = 8) -> dict[str, list[tuple[float | None, float]]]:
    """Scales (and clips) the projections of `weights` in place, folding the inverse scales into
    the norms / preceding projections. Returns each group's search history (for reports)."""
    shape, rope = BlockShape.from_config(hf_config), Rope(hf_config)
    n = samples.shape[0]
    pick = torch.linspace(0, n - 1, min(search_samples, n)).round().long().unique()
    hidden = _embed(weights, samples)
    histories: dict[str, list[tuple[float | None, float]]] = {}
    eps = shape.eps
    for i in range(_num_layers(hf_config)):
        t0 = time.perf_counter()
        w = layer_weights(weights, i)
        ln1, ln2 = w["input_layernorm.weight"], w["post_attention_layernorm.weight"]
        sums = {"x1": 0.0, "attn": 0.0, "x2": 0.0, "act": 0.0}
        out = torch.empty_like(hidden)
        for b0 in range(0, n, batch_size):
            h = hidden[b0:b0 + batch_size]
            x1 = rms_norm(h, ln1, eps)
            a = attention_core(x1, w, shape, rope)
            h2 = h + linear(a, w, "o_proj")
            x2 = rms_norm(h2, ln2, eps)
            act = mlp_act(x2, w)
            out[b0:b0 + batch_size] = h2 + linear(act, w, "down_proj")
            for key, t in (("x1", x1), ("attn", a), ("x2", x2), ("act", act)):
                sums[key] = sums[key] + t.abs().reshape(-1, t.shape[-1]).sum(0)
        means = {k: v / samples.numel() for k, v in sums.items()}
        # the search subset's features
        h = hidden[pick]
        x1 = rms_norm(h, ln1, eps)
        a = attention_core(x1, w, shape, rope)
        x2 = rms_norm(h + linear(a, w, "o_proj"), ln2, eps)
        act = mlp_act(x2, w)

        def search(names, x_mean, forward, reference):
            s, _, hist = awq.search_scales(x_mean, {nm: w[nm + ".weight"] for nm in names}, forward, reference,
                                           grid.fake, grid.group_size, n_grid)
            histories[f"model.layers.{i}.{'+'.join(names)}"] = hist
            for nm in names:
                w[nm + ".weight"] = w[nm + ".weight"] * s
            return s

        s = search(QKV, means["x1"], lambda ws: self_attn(x1, {**w, **_named(ws)}, shape, rope),
                   self_attn(x1, w, shape, rope))
        w["input_layernorm.weight"] = ln1 / s
        x1 = x1 / s
        if w["v_proj.weight"].shape[0] == w["o_proj.weight"].shape[1]:
            s = search(("o_proj",), means["attn"], lambda ws: linear(a, {**w, **_named(ws)}, "o_proj"), linear(a, w, "o_proj"))
            w["v_proj.weight"] = w["v_proj.weight"] / s[:, None]
            if "v_proj.bias" in w:
                w["v_proj.bias"] = w["v_proj.bias"] / s
            a = a / s
        s = search(GATE_UP, means["x2"], lambda ws: mlp(x2, {**w, **_named(ws)}), mlp(x2, w))
        w["post_attention_layernorm.weight"] = ln2 / s
        x2 = x2 / s
        s = search(("down_proj",), means["act"], lambda ws: linear(act, {**w, **_named(ws)}, "down_proj"),
                   linear(act, w, "down_proj"))
        w["up_proj.weight"] = w["up_proj.weight"] / s[:, None]
        if "up_proj.bias" in w:
            w["up_proj.bias"] = w["up_proj.bias"] / s
        act = act / s
        if clip:  # AutoAWQ's auto_clip, q/k excluded
            for nm, x in (("v_proj", x1), ("o_proj", a), ("gate_proj", x2), ("up_proj", x2), ("down_proj", act)):
                max_val = awq.search_clip(w[nm + ".weight"], x, grid.fake, grid.group_size)
                w[nm + ".weight"] = awq.apply_clip(w[nm + ".weight"], max_val, grid.group_size)
        for short, t in w.items():
            name = full_name(i, short)
            weights[name] = t.to(weights[name].dtype)
        hidden = out
        logger.info("awq: layer %d scaled%s in %.1f s", i, " and clipped" if clip else "", time.perf_counter() - t0)
    return histories


def _named(ws: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`{short name: W}` of `search_scales`' trial weights as layer-weight keys."""
    return {nm + ".weight": t for nm, t in ws.items()}

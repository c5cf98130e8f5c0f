"""Held-out perplexity of models (HF folders, quantized checkpoint folders, GGUF files) on the text
shipped with pagedllm (`pagedllm/data/heldout.txt`, never used for calibration).

    python -m benchmarks.perplexity FLOAT_FOLDER QUANT_FOLDER ... [--hf-reference]
    python -m benchmarks.perplexity default /tmp/smollm2-gptq --hf-reference FLOAT_FOLDER

The text is tokenized once by the first model's tokenizer (all models must share it), cut into
windows of `--window` tokens every `--stride` tokens; each window's tokens after the first are
scored (with stride < window, only the tokens not scored by an earlier window), so every token
but the first of the text is predicted exactly once. Perplexity = exp(mean negative
log-likelihood).

pagedllm rows go through pagedllm's own engine: each window is one request with
`prompt_logprobs=0` (the log-probability of each prompt token given the tokens before it,
computed from the logits of the real model forward and kernels). `--hf-reference FOLDER`
adds transformers' float32 forward of a float folder (or GGUF) as the reference row; the ratio
column divides by it (else by the first float model's pagedllm row).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) of each window; every position 1..n-1 scored once."""
    if window < 2 or not 0 < stride <= window:
        raise ValueError(f"need window >= 2 and 0 < stride <= window, got {window}, {stride}")
    out, scored_to = [], 1
    start = 0
    while scored_to < n_tokens:
        end = min(start + window, n_tokens)
        out.append((start, end, max(scored_to, start + 1)))
        scored_to = end
        start += stride
    return out


def describe(model: str) -> dict:
    """format, method, bits, group size of a model argument."""
    from pagedllm.model_source import resolve_model

    src = resolve_model(None if model == "default" else model)
    if src.is_gguf:
        return {"format": "gguf", "method": src.gguf_file.rsplit(".", 2)[-2], "bits": "", "group_size": ""}
    cfg = json.loads((Path(src.path) / "config.json").read_text())
    qc = cfg.get("quantization_config")
    if not qc:
        return {"format": "float32", "method": "-", "bits": 32, "group_size": ""}
    if qc["quant_method"] == "compressed-tensors":
        w = qc["config_groups"]["group_0"]["weights"]
        method = w.get("observer", "")
        return {"format": "compressed-tensors", "method": method, "bits": w["num_bits"],
                "group_size": w.get("group_size") or -1}
    meta = (qc.get("meta") or {}).get("quantizer") or []
    method = meta[0].split(":")[-1] if meta else qc["quant_method"]
    if qc.get("desc_act"):
        method += "+act-order"
    return {"format": qc["quant_method"], "method": method, "bits": qc.get("bits", qc.get("w_bit")),
            "group_size": qc.get("group_size", qc.get("q_group_size"))}


def split_compute(spec: str) -> tuple[str, str]:
    """`MODEL@int8` / `MODEL@exact`: the model and its quant_compute (default auto)."""
    model, sep, compute = spec.rpartition("@")
    if sep and compute in ("auto", "exact", "int8"):
        return model, compute
    return spec, "auto"


def nll_pagedllm(spec: str, ids: list[int], spans, window: int) -> tuple[float, int, float]:
    from pagedllm import LLM, SamplingParams

    model, compute = split_compute(spec)
    llm = LLM(None if model == "default" else model, max_model_len=window + 8, kv_cache_space=1.0,
              enable_prefix_caching=False, quant_compute=compute)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids[s:e]} for s, e, _ in spans], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    total, count = 0.0, 0
    for (s, e, first), o in zip(spans, outs):
        for pos in range(first, e):
            entry = o.prompt_logprobs[pos - s]
            total -= entry[ids[pos]].logprob
            count += 1
    return total, count, elapsed


def nll_transformers(model: str, ids: list[int], spans) -> tuple[float, int, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.model_source import resolve_model

    src = resolve_model(None if model == "default" else model)
    kw = {"gguf_file": src.gguf_file} if src.is_gguf else {}
    hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32, **kw).eval()
    total, count = 0.0, 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s, e, first in spans:
            logits = hf(torch.tensor([ids[s:e]])).logits[0].float()
            lp = torch.log_softmax(logits[first - s - 1:e - s - 1], dim=-1)
            tgt = torch.tensor(ids[first:e])
            total -= float(lp.gather(1, tgt[:, None]).sum())
            count += e - first
    return total, count, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="HF / quantized folders, .gguf files, or 'default' (SmolLM2 GGUF); "
                    "a suffix @exact / @int8 picks the quant_compute path")
    ap.add_argument("--hf-reference", default=None, help="a float folder (or GGUF): transformers float32 row")
    ap.add_argument("--text", default=None, help="a UTF-8 text file (default: pagedllm/data/heldout.txt)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    ap.add_argument("--label", action="append", default=[], help="MODEL=LABEL: a name for a row")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    from pagedllm.model_source import resolve_model
    from pagedllm.quantization.algorithms.calibration import HELDOUT, shipped_text
    from pagedllm.tokenizer import load_tokenizer

    text = shipped_text(HELDOUT) if args.text is None else Path(args.text).read_text(encoding="utf-8")
    first_model = split_compute(args.models[0])[0]
    first = resolve_model(None if first_model == "default" else first_model)
    ids = load_tokenizer(first.path, first.gguf_file)(text, add_special_tokens=False)["input_ids"]
    spans = windows(len(ids), args.window, args.stride)[: args.max_windows]
    labels = dict(lbl.split("=", 1) for lbl in args.label)
    print(f"{len(ids)} tokens, {len(spans)} windows of {args.window} (stride {args.stride})", file=sys.stderr)

    rows = []
    if args.hf_reference:
        total, count, el = nll_transformers(args.hf_reference, ids, spans)
        rows.append({"model": labels.get(args.hf_reference, args.hf_reference), "engine": "transformers",
                     **describe(args.hf_reference), "tokens": count, "ppl": math.exp(total / count), "seconds": el})
        print(f"transformers {args.hf_reference}: {rows[-1]['ppl']:.4f}", file=sys.stderr)
    for model in args.models:
        total, count, el = nll_pagedllm(model, ids, spans, args.window)
        rows.append({"model": labels.get(model, model), "engine": "pagedllm", **describe(split_compute(model)[0]),
                     "quant_compute": split_compute(model)[1], "tokens": count,
                     "ppl": math.exp(total / count), "seconds": el})
        print(f"pagedllm {model}: {rows[-1]['ppl']:.4f}", file=sys.stderr)
    base = rows[0]["ppl"] if args.hf_reference else next(
        (r["ppl"] for r in rows if r["format"] == "float32"), rows[0]["ppl"])
    print("| model | engine | format | method | bits | group | perplexity | ratio to float32 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        r["ratio"] = r["ppl"] / base
        print(f"| {r['model']} | {r['engine']} | {r['format']} | {r['method']} | {r['bits']} | {r['group_size']} "
              f"| {r['ppl']:.3f} | {r['ratio']:.4f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"tokens": len(ids), "window": args.window, "stride": args.stride,
                                                   "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

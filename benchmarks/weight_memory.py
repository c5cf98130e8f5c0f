"""Weight memory per model / format: bytes of the tensors the loaded model keeps, and the RSS
growth of loading it (each model in its own child process, after a warm kernel cache).

    python -m benchmarks.weight_memory default /tmp/q/gptq4-ao /tmp/q/awq4 ...
    PAGEDLLM_GGUF_BLOCKS=0 python -m benchmarks.weight_memory default   # the old GGUF path

Columns: the decoder's linear layers (the quantized ones) in MB and as a share of their float16
bytes; the embedding / LM head; every tensor the model holds; RSS after load minus before.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import gc, json, os, sys, torch
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
from pagedllm.model_source import resolve_model, load_hf_config
from pagedllm.model.loader import load_model
from pagedllm.layers.linear import Linear, VocabEmbedding
src = resolve_model(None if sys.argv[1] == "default" else sys.argv[1])
cfg = load_hf_config(src)
gc.collect(); before = rss()
model = load_model(src.path, src.gguf_file, cfg, torch.float32, "cpu", quant_compute=sys.argv[2])
gc.collect(); after = rss()
def tensor_bytes(t):
    return 0 if t is None else t.numel() * t.element_size()
def prepared_bytes(p):
    return 0 if p is None else (p.blocks.data.numel() if p.blocks is not None else 0) + tensor_bytes(p.packed)
lin = lin_fp16 = 0
for m in model.modules():
    if isinstance(m, Linear):
        lin_fp16 += 2 * m.input_size * m.output_size
        iw = getattr(m, "int_weight", None)
        lin += iw.data.numel() if iw is not None else 0
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            lin += tensor_bytes(t)
        lin += prepared_bytes(getattr(m, "prepared", None))
emb = model.model.embed_tokens
emb_bytes = (emb.int_weight.data.numel() if emb.int_weight is not None else 0) + tensor_bytes(emb.weight)
emb_bytes += prepared_bytes(model.head_prepared)
if model.lm_head is not None:
    emb_bytes += tensor_bytes(model.lm_head.weight) + prepared_bytes(model.lm_head.prepared)
total = lin + emb_bytes + sum(tensor_bytes(p) for n, p in model.named_parameters()
                              if "embed_tokens" not in n and "lm_head" not in n and not isinstance(
                                  model.get_submodule(n.rpartition(".")[0]), Linear))
print(json.dumps({"linear_mb": lin / 1e6, "linear_share_of_fp16": lin / lin_fp16, "embedding_head_mb": emb_bytes / 1e6,
                  "all_tensors_mb": total / 1e6, "rss_delta_mb": (after - before) / 1e6}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("models", nargs="+", help="'default' (SmolLM2 GGUF), a .gguf file or a folder")
    p.add_argument("--quant-compute", default="auto")
    p.add_argument("--label", action="append", default=[], help="MODEL=LABEL")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    labels = dict(x.split("=", 1) for x in args.label)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print("| model | linear layers MB | share of their fp16 bytes | embedding + head MB | all tensors MB | RSS delta MB |")
    print("|---|---|---|---|---|---|")
    for model in args.models:
        proc = subprocess.run([sys.executable, "-c", _CHILD, model, args.quant_compute], cwd=root,
                              capture_output=True, text=True, check=False)
        if proc.returncode:
            print(proc.stderr[-2000:], file=sys.stderr)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        name = labels.get(model, os.path.basename(model.rstrip("/")))
        if os.environ.get("PAGEDLLM_GGUF_BLOCKS") == "0":
            name += " (PAGEDLLM_GGUF_BLOCKS=0)"
        print(f"| {name} | {r['linear_mb']:.1f} | {r['linear_share_of_fp16']:.1%} | {r['embedding_head_mb']:.1f} | "
              f"{r['all_tensors_mb']:.1f} | {r['rss_delta_mb']:.0f} |")
        if args.json_out:
            with open(args.json_out, "a") as f:
                f.write(json.dumps({"model": name, **r}) + "\n")


if __name__ == "__main__":
    main()

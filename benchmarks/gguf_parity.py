"""Greedy output of pagedllm on GGUF files against transformers loading the same file.

For each `.gguf` in the folder (e.g. the default model requantized by llama.cpp's
`llama-quantize` into every type): the tensor types it holds, transformers' greedy continuation
of a few prompts (float32, the file dequantized by gguf-py), and pagedllm's with
`quant_compute=exact` (must be equal) and `int8` (the first differing token, reported).

    python -m benchmarks.gguf_parity /tmp/gguf-files/smollm2 [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os

import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("folder")
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams
    from pagedllm.model.gguf_index import read_gguf_index
    from tests.integration.test_engine_parity import hf_greedy

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print("| file | tensor types | exact == transformers | int8: first differing token per prompt |")
    print("|---|---|---|---|")
    for path in sorted(glob.glob(os.path.join(args.folder, "*.gguf"))):
        types = collections.Counter(t.tensor_type.name for t in read_gguf_index(path).tensors)
        folder, name = os.path.split(path)
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        exact = LLM(path, kv_cache_space=0.25)
        tok = exact.get_tokenizer()
        ids = [tok.encode(text) for text in PROMPTS]
        ref = [hf_greedy(hf, q, args.max_tokens) for q in ids]
        prompts = [{"prompt_token_ids": q} for q in ids]
        ours = [o.outputs[0].token_ids for o in exact.generate(prompts, params, use_tqdm=False)]
        int8 = [o.outputs[0].token_ids for o in LLM(path, kv_cache_space=0.25, quant_compute="int8")
                .generate(prompts, params, use_tqdm=False)]
        diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(int8, ref)]
        same = sum(a == b for a, b in zip(ours, ref))
        kinds = ", ".join(f"{k}:{v}" for k, v in sorted(types.items()))
        print(f"| {name} | {kinds} | {same}/{len(ref)} | {diff} |", flush=True)
        del hf, exact


if __name__ == "__main__":
    main()

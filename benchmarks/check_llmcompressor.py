"""Developer check (not CI): quantize the float SmolLM2 with llm-compressor's GPTQModifier (W4A16,
symmetric, group 64, the same calibration windows as `pagedllm quantize --method gptq`) and write
its compressed-tensors folder, for `benchmarks/perplexity.py` to compare with ours.

llm-compressor is never a dependency; install it aside, without torch (it pins a transformers
older than the venv's, so the target folder must come first on the path):

    pip install --no-deps --target /tmp/llmc-pkgs llmcompressor==0.14.0.1 transformers==5.17.0 \
        compressed-tensors==0.19.0 loguru auto-round==0.15.1 datasets pyarrow dill multiprocess xxhash nvidia-ml-py
    PYTHONPATH=/tmp/llmc-pkgs .venv/bin/python -m benchmarks.check_llmcompressor FLOAT_FOLDER OUT [--group-size 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="a float HF folder")
    ap.add_argument("out")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--num-samples", type=int, default=None)
    args = ap.parse_args(argv)

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.quantization.algorithms.calibration import calibration_samples, read_text

    tok = AutoTokenizer.from_pretrained(args.model)
    samples = calibration_samples(tok, read_text(None), args.num_samples, args.seq_len)
    ds = Dataset.from_dict({"input_ids": samples.tolist(), "attention_mask": torch.ones_like(samples).tolist()})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    scheme = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                             "strategy": "group", "group_size": args.group_size}}}
    recipe = GPTQModifier(config_groups=scheme, ignore=["lm_head"], dampening_frac=0.01, block_size=128)
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=args.seq_len,
            num_calibration_samples=samples.shape[0])
    print(f"llm-compressor GPTQ on {tuple(samples.shape)} tokens: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    model.save_pretrained(args.out, save_compressed=True)
    tok.save_pretrained(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

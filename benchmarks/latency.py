"""Latency of one batch: the prefill step and the decode steps timed separately.

    python -m benchmarks.latency --batch-size 20 --input-len 128 --output-len 128 --num-iters 3

The batch is admitted in one step (the token budget is raised to hold every prompt), so the
first step is the batch's prefill and every later step one decode token per sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_once(engine, batch_size: int, input_len: int, output_len: int, seed: int) -> dict:
    import random

    from pagedllm import SamplingParams

    rng = random.Random(seed)
    vocab = engine.hf_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch_size):
        ids = [rng.randrange(100, vocab) for _ in range(input_len)]
        engine.add_request(f"lat-{seed}-{i}", {"prompt_token_ids": ids}, params)
    step_times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t)
    prefill, decodes = step_times[0], step_times[1:]
    return {"prefill_s": prefill, "decode_step_s": statistics.median(decodes),
            "decode_p90_s": sorted(decodes)[int(0.9 * (len(decodes) - 1))],
            "total_s": sum(step_times)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--kv-cache-space", type=float, default=2.0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    from pagedllm.engine.engine import LLMEngine

    engine = LLMEngine.from_kwargs(
        model=args.model, kv_cache_space=args.kv_cache_space, enforce_eager=args.enforce_eager,
        max_num_seqs=max(args.batch_size, 1),
        max_num_batched_tokens=max(2048, args.batch_size * args.input_len),
        enable_prefix_caching=False,
    )
    run_once(engine, args.batch_size, args.input_len, min(args.output_len, 4), seed=-1)  # warm-up
    runs = [run_once(engine, args.batch_size, args.input_len, args.output_len, seed=i)
            for i in range(args.num_iters)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    result = {
        "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "prefill_ms": round(med["prefill_s"] * 1000, 1),
        "prefill_tokens_per_s": round(args.batch_size * args.input_len / med["prefill_s"], 1),
        "decode_step_ms": round(med["decode_step_s"] * 1000, 2),
        "decode_p90_ms": round(med["decode_p90_s"] * 1000, 2),
        "decode_tokens_per_s": round(args.batch_size / med["decode_step_s"], 1),
        "total_s": round(med["total_s"], 2), "iters": args.num_iters,
    }
    print(json.dumps(result))
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()

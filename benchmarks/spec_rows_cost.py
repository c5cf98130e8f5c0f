"""What verifying k + 1 rows costs against a one-token step (issue 26: choosing
`num_speculative_tokens` on a CPU).

    flock /tmp/pagedllm-cpu.lock python -m benchmarks.spec_rows_cost --ks 0,1,2,3,4,5,6,7,8,9,11,15
    PAGEDLLM_KERNEL_MARCH=x86-64-v3 flock /tmp/pagedllm-cpu.lock python -m benchmarks.spec_rows_cost --ks 0,3,4,7   # the AVX2 build

One sequence decodes a cyclic prompt (40 token ids repeated 6 times) greedily with
`{"method": "ngram", "num_speculative_tokens": k}` (k = 0: the plain engine), so that nearly
every step verifies k + 1 rows. Per k: a fresh engine, one warm-up generation, then 5 timed
generations of 8 (k + 1) + 1 tokens after the prompt is cached; printed: the median ms per engine
step and tokens per step. With an integer-kernel model (the default Q4_1 GGUF) and the
AVX-512 build the cost is nearly flat up to the kernel's row tile (kernels/int_gemm.c `MRE`:
8 rows) and jumps after it; the AVX2 build's grows from the first row (docs/speculative_decoding.md).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def step_cost(model: str | None, k: int, repeats: int = 5) -> tuple[float, float]:
    """(median ms per engine step, median tokens per step) for k drafts (0: plain)."""
    from pagedllm import LLM, SamplingParams

    from benchmarks.spec_decode import spec_config

    kw = {} if k == 0 else {"speculative_config": spec_config(k)}
    llm = LLM(model, **kw)
    prompt = {"prompt_token_ids": list(range(1000, 1040)) * 6}
    params = SamplingParams(temperature=0.0, max_tokens=8 * (k + 1) + 1, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    core = llm.llm_engine.core
    ms, per_step = [], []
    for _ in range(repeats):
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)  # cached prompt
        s0, t = core.counters.num_steps, time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        dt, steps = time.perf_counter() - t, core.counters.num_steps - s0
        ms.append(dt * 1000 / steps)
        per_step.append(len(out.outputs[0].token_ids) / steps)
    llm.shutdown()
    del llm
    gc.collect()
    return statistics.median(ms), statistics.median(per_step)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1 GGUF")
    p.add_argument("--ks", default="0,1,2,3,4,5,6,7,8,9,11,15")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    rows = []
    for k in (int(x) for x in args.ks.split(",") if x):
        ms, tps = step_cost(args.model, k, args.repeats)
        rows.append({"k": k, "rows": k + 1, "ms_per_step": round(ms, 2), "tokens_per_step": round(tps, 2)})
        print(f"k={k} rows={k + 1} ms/step={ms:.2f} tokens/step={tps:.2f}", flush=True)
    return rows


if __name__ == "__main__":
    main()

"""KV cache element types side by side on SmolLM2 (docs/kv_cache.md): per `kv_cache_dtype`,

1. blocks (and tokens) that a fixed `--kv-cache-space` budget holds;
2. a fixed workload (benchmarks/workloads.py, default seed20: 20 requests, EOS ignored) all
   submitted at once on that budget: peak and mean requests running at once, preemptions,
   output tokens per second (median of `--repeats` timed runs after one warm-up run);
3. perplexity of the shipped held-out text (pagedllm/data/heldout.txt, windows of `--window`
   tokens, each a request with `prompt_logprobs=1`: every token's log-probability given the
   tokens before it) and teacher-forced top-1 agreement with float32 (the most likely next
   token equal to float32's);
4. greedy first divergence: `--prompts` prompts (slices of the same text) generate
   `--max-tokens` tokens greedily; for each, the first position where the output differs from
   float32's (= max_tokens when identical).

    flock /tmp/pagedllm-cpu.lock python -m benchmarks.kv_cache_dtype --json-out benchmarks/results/kv_cache_dtype.json

Timings need the CPU to themselves: run it under the lock on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.perplexity import windows  # noqa: E402
from benchmarks.workloads import load_workload  # noqa: E402

DTYPES = ("float32", "bfloat16", "int8")


def run_workload(llm, reqs) -> dict:
    """Submit every request at once and step to the end; running requests per step."""
    from pagedllm import SamplingParams

    engine = llm.llm_engine
    before = engine.kv_cache_stats().num_preemptions
    for i, r in enumerate(reqs):
        engine.add_request(f"kvd-{i}", {"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True))
    running, out_tokens = [], 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                out_tokens += len(out.outputs[0].token_ids)
        running.append(len({s.request_id for s in engine.scheduler.running}))
    elapsed = time.perf_counter() - t0
    assert out_tokens == sum(r.max_tokens for r in reqs)
    return {"elapsed_s": elapsed, "output_tokens": out_tokens, "peak_running": max(running),
            "mean_running": statistics.fmean(running),
            "preemptions": engine.kv_cache_stats().num_preemptions - before}


def scored_logprobs(llm, ids: list[int], spans) -> tuple[list[float], list[int]]:
    """Per scored position: the log-probability of the text's token, and the top-1 token."""
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": ids[s:e]} for s, e, _ in spans], params, use_tqdm=False)
    lps, top = [], []
    for (s, e, first), o in zip(spans, outs):
        for pos in range(first, e):
            entry = o.prompt_logprobs[pos - s]
            lps.append(entry[ids[pos]].logprob)
            top.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return lps, top


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--kv-cache-space", type=float, default=0.05, help="GiB: the fixed budget of rows 1-2")
    ap.add_argument("--workload", default="seed20")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    from pagedllm import LLM, SamplingParams
    from pagedllm.quantization.algorithms.calibration import HELDOUT, shipped_text

    dtypes = args.dtypes.split(",")
    rows: dict[str, dict] = {}
    ref: dict[str, list] = {}
    for dt in dtypes:
        row: dict = {"kv_cache_dtype": dt}
        # 1-2: the small budget.
        llm = LLM(kv_cache_dtype=dt, kv_cache_space=args.kv_cache_space, max_model_len=2048)
        engine = llm.llm_engine
        reqs = load_workload(args.workload, int(engine.hf_config.vocab_size))
        row.update(num_blocks=engine.num_blocks, tokens=engine.num_blocks * engine.block_size,
                   bytes_per_block=engine.bytes_per_block, num_host_blocks=engine.num_host_blocks)
        run_workload(llm, reqs)  # warm-up (kernels built, pages touched)
        runs = [run_workload(llm, reqs) for _ in range(args.repeats)]
        times = [r["elapsed_s"] for r in runs]
        row.update(peak_running=runs[0]["peak_running"], mean_running=runs[0]["mean_running"],
                   preemptions=runs[0]["preemptions"], seconds=times,
                   median_s=statistics.median(times),
                   tokens_per_s=runs[0]["output_tokens"] / statistics.median(times))
        del llm, engine
        # 3-4: a roomy cache, so that only the element type differs.
        llm = LLM(kv_cache_dtype=dt, kv_cache_space=1.0, max_model_len=2048, enable_prefix_caching=False)
        tok = llm.get_tokenizer()
        ids = tok(shipped_text(HELDOUT), add_special_tokens=False)["input_ids"]
        spans = windows(len(ids), args.window, args.window)[: args.max_windows]
        lps, top = scored_logprobs(llm, ids, spans)
        row.update(scored_tokens=len(lps), perplexity=math.exp(-statistics.fmean(lps)))
        step = max(1, (len(ids) - args.prompt_len) // args.prompts)
        prompts = [{"prompt_token_ids": ids[i * step: i * step + args.prompt_len]} for i in range(args.prompts)]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                            use_tqdm=False)
        greedy = [o.outputs[0].token_ids for o in outs]
        if not ref:
            ref.update(lps=lps, top=top, greedy=greedy, dtype=dt)
        row["reference"] = ref["dtype"]
        row["top1_agreement"] = statistics.fmean(a == b for a, b in zip(top, ref["top"]))
        row["mean_abs_logprob_diff"] = statistics.fmean(abs(a - b) for a, b in zip(lps, ref["lps"]))
        div = [first_divergence(g, r) for g, r in zip(greedy, ref["greedy"])]
        row.update(first_divergence=div, identical=sum(d == args.max_tokens for d in div),
                   median_first_divergence=statistics.median(div), min_first_divergence=min(div))
        rows[dt] = row
        del llm
        print(f"{dt}: {json.dumps({k: v for k, v in row.items() if k not in ('first_divergence', 'seconds')})}",
              file=sys.stderr)

    base = rows[dtypes[0]]
    print(f"budget {args.kv_cache_space} GiB, workload {args.workload} ({args.repeats} timed runs, median); "
          f"perplexity over {base['scored_tokens']} tokens of heldout.txt; greedy first divergence over "
          f"{args.prompts} prompts x {args.max_tokens} tokens vs {base['kv_cache_dtype']}")
    print("| kv_cache_dtype | bytes/block | blocks | x | peak running | mean running | preemptions "
          "| tok/s | x | perplexity | top-1 agree | identical | median first div | min first div |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dt, r in rows.items():
        print(f"| {dt} | {r['bytes_per_block']} | {r['num_blocks']} | {r['num_blocks'] / base['num_blocks']:.2f} "
              f"| {r['peak_running']} | {r['mean_running']:.1f} | {r['preemptions']} | {r['tokens_per_s']:.0f} "
              f"| {r['tokens_per_s'] / base['tokens_per_s']:.2f} | {r['perplexity']:.4f} | {r['top1_agreement']:.4f} "
              f"| {r['identical']}/{args.prompts} | {r['median_first_divergence']} | {r['min_first_divergence']} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

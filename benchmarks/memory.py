"""KV cache memory on SmolLM2: paging waste, concurrency at a fixed budget, sharing by parallel
sampling and beam search, prefix caching. One run prints a table and writes JSON.

    python -m benchmarks.memory --json-out benchmarks/results/memory.json
    pagedllm bench memory            (same flags)

1. waste: seed20 (20 requests, prompts 78-178 random tokens, outputs 156-356, EOS ignored),
   all at once on a large pool. At the step with the most blocks in use: unused slots of the
   paged blocks vs. reserving max_model_len, or prompt + max_tokens, per running request.
2. concurrency: seed20 on a fixed budget of --budget-blocks blocks: requests running at once
   (peak, and mean over steps) vs. how many contiguous reservations fit in the same budget.
3. parallel sampling n=4 and n=8 of the seed20 prompts (--sample-max-tokens each): peak blocks
   in use vs. peak block-table entries (what the same sequences hold as unshared copies).
4. beam search, width 5, the seed20 prompts: the same comparison.
5. prefix caching: 32 requests = one 512-token system prompt + a 32-token question each, all
   at once, caching on vs off: prompt tokens computed, time to first token, outputs equal.

Peaks are observed after every engine step (a step's finished requests have given back their
blocks). Rows 3 and 4 count the unshared copies in the same run (block-table entries = the sum
of ref counts), which is what independent copies would hold under the same schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.workloads import BenchRequest, load_workload  # noqa: E402


@dataclass
class Trace:
    """Per-step observations of one engine run."""

    physical: list[int] = field(default_factory=list)  # blocks with ref_count > 0
    logical: list[int] = field(default_factory=list)  # block-table entries (unshared copies)
    tokens: list[int] = field(default_factory=list)  # slots holding a computed token
    running: list[list[str]] = field(default_factory=list)  # request ids with a running seq
    prefill_tokens: int = 0  # prompt positions run through the model
    elapsed_s: float = 0.0

    def peak_step(self) -> int:
        return max(range(len(self.physical)), key=lambda i: (self.physical[i], self.tokens[i]))


def drive(llm, requests: list[tuple[Any, Any]], trace: Trace) -> list:
    """Submit every (prompt, params) at once and step until all finish, observing each step."""
    from pagedllm.engine.kv_stats import KVCacheStatsTracker

    engine = llm.llm_engine
    kv, sched = engine.kv_cache_manager, engine.scheduler
    schedule = sched.schedule

    def counting_schedule():  # prompt positions scheduled: the prefill work actually done
        out = schedule()
        for s in out.scheduled:
            trace.prefill_tokens += max(0, min(s.start_pos + len(s.token_ids), s.seq.prompt_len)
                                        - s.start_pos)
        return out

    ids = [f"mem-{i}" for i in range(len(requests))]
    for rid, (prompt, params) in zip(ids, requests):
        engine.add_request(rid, prompt, params)
    done: dict[str, Any] = {}
    sched.schedule = counting_schedule
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            trace.physical.append(kv.num_blocks - kv.num_free_blocks)
            trace.logical.append(sum(len(kv.get_block_ids(s.seq_id)) for s in sched.running))
            trace.tokens.append(KVCacheStatsTracker.count_stored_tokens(
                sched.running, kv.get_block_ids, kv.block_size))
            trace.running.append(sorted({s.request_id for s in sched.running}))
    finally:
        sched.schedule = schedule
    trace.elapsed_s = time.perf_counter() - t0
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    return [done[r] for r in ids]


def _prompts(reqs: list[BenchRequest]) -> list[dict]:
    return [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]


# ---- the five measurements ----------------------------------------------------------------------


def waste_row(llm, reqs: list[BenchRequest], max_model_len: int) -> dict:
    from pagedllm import SamplingParams

    trace = Trace()
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in reqs]
    outs = drive(llm, list(zip(_prompts(reqs), params)), trace)
    assert all(len(o.outputs[0].token_ids) == r.max_tokens for o, r in zip(outs, reqs))
    i = trace.peak_step()
    B = llm.llm_engine.block_size
    tokens, blocks = trace.tokens[i], trace.physical[i]
    by_id = {f"mem-{k}": r for k, r in enumerate(reqs)}
    running = [by_id[rid] for rid in trace.running[i]]
    reserved_max = len(running) * max_model_len
    reserved_need = sum(len(r.prompt_token_ids) + r.max_tokens for r in running)
    return {
        "row": "1. KV waste at peak (seed20)",
        "running_requests": len(running), "tokens_stored": tokens, "paged_blocks": blocks,
        "paged_waste": 1 - tokens / (blocks * B),
        "reserve_max_model_len_waste": 1 - tokens / reserved_max,
        "reserve_prompt_plus_max_tokens_waste": 1 - tokens / reserved_need,
        "max_model_len": max_model_len, "elapsed_s": trace.elapsed_s,
    }


def concurrency_row(llm, reqs: list[BenchRequest], max_model_len: int) -> dict:
    from pagedllm import SamplingParams

    engine = llm.llm_engine
    budget_tokens = engine.num_blocks * engine.block_size
    trace = Trace()
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in reqs]
    drive(llm, list(zip(_prompts(reqs), params)), trace)
    counts = [len(r) for r in trace.running]
    fit, used = 0, 0  # contiguous prompt + max_tokens reservations, first come first served
    for r in reqs:
        need = len(r.prompt_token_ids) + r.max_tokens
        if used + need > budget_tokens:
            break
        fit, used = fit + 1, used + need
    return {
        "row": "2. concurrent requests in a fixed budget",
        "budget_blocks": engine.num_blocks, "budget_tokens": budget_tokens,
        "paged_peak": max(counts), "paged_mean": statistics.mean(counts),
        "reserve_max_model_len": budget_tokens // max_model_len,
        "reserve_prompt_plus_max_tokens": fit,
        "num_preemptions": llm.kv_cache_stats().num_preemptions, "elapsed_s": trace.elapsed_s,
    }


def sharing_row(name: str, llm, requests: list[tuple[Any, Any]]) -> dict:
    llm.reset_prefix_cache()  # no hits from earlier runs: all sharing is by fork here
    trace = Trace()
    drive(llm, requests, trace)
    shared, independent = max(trace.physical), max(trace.logical)
    return {"row": name, "shared_peak_blocks": shared, "independent_peak_blocks": independent,
            "ratio": shared / independent, "elapsed_s": trace.elapsed_s}


def parallel_sampling_row(llm, reqs: list[BenchRequest], n: int, max_tokens: int) -> dict:
    from pagedllm import SamplingParams

    requests = [(p, SamplingParams(n=n, temperature=0.8, seed=i, max_tokens=max_tokens,
                                   ignore_eos=True))
                for i, p in enumerate(_prompts(reqs))]
    row = sharing_row(f"3. parallel sampling n={n}", llm, requests)
    row.update(n=n, max_tokens=max_tokens, prompts=len(reqs))
    return row


def beam_row(llm, reqs: list[BenchRequest], width: int, max_tokens: int) -> dict:
    from pagedllm import BeamSearchParams

    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    row = sharing_row(f"4. beam search width {width}", llm, [(p, params) for p in _prompts(reqs)])
    row.update(width=width, max_tokens=max_tokens, prompts=len(reqs))
    return row


def prefix_row(llm_on, llm_off, vocab: int, num: int, system_len: int, question_len: int,
               max_tokens: int, seed: int) -> dict:
    from pagedllm import SamplingParams

    rng = random.Random(seed)
    system = [rng.randrange(100, vocab) for _ in range(system_len)]
    prompts = [{"prompt_token_ids": system + [rng.randrange(100, vocab)
                                              for _ in range(question_len)]}
               for _ in range(num)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    res: dict[str, Any] = {"row": "5. prefix caching", "requests": num,
                           "system_len": system_len, "question_len": question_len}
    outputs = {}
    for name, llm in (("on", llm_on), ("off", llm_off)):
        llm.reset_prefix_cache()
        trace = Trace()
        outs = drive(llm, [(p, params) for p in prompts], trace)
        ttft = [o.metrics.time_to_first_token for o in outs]
        outputs[name] = [o.outputs[0].token_ids for o in outs]
        res[f"prefill_tokens_{name}"] = trace.prefill_tokens
        res[f"ttft_mean_s_{name}"] = statistics.mean(ttft)
        res[f"ttft_max_s_{name}"] = max(ttft)
        res[f"elapsed_s_{name}"] = trace.elapsed_s
        if name == "on":
            hits = sum(min(o.num_cached_tokens or 0, system_len) for o in outs)
            res["prefix_served_from_cache"] = hits / (num * system_len)
    res["outputs_identical"] = outputs["on"] == outputs["off"]
    return res


# ---- report ---------------------------------------------------------------------------------------


def markdown_table(rows: list[dict]) -> str:
    pct = "{:.1%}".format
    r1, r2, r3a, r3b, r4, r5 = rows
    lines = [
        "| # | measurement | result | target |",
        "|---|---|---|---|",
        f"| 1 | KV waste at the peak ({r1['running_requests']} requests running) | paged "
        f"**{pct(r1['paged_waste'])}** vs reserving max_model_len={r1['max_model_len']}: "
        f"{pct(r1['reserve_max_model_len_waste'])}, reserving prompt + max_tokens: "
        f"{pct(r1['reserve_prompt_plus_max_tokens_waste'])} | paged < 4% |",
        f"| 2 | concurrent requests in {r2['budget_blocks']} blocks ({r2['budget_tokens']} "
        f"tokens) | paged **{r2['paged_peak']}** at peak ({r2['paged_mean']:.1f} mean over steps, "
        f"{r2['num_preemptions']} preemptions) vs reserving max_model_len: "
        f"{r2['reserve_max_model_len']}, reserving prompt + max_tokens: "
        f"{r2['reserve_prompt_plus_max_tokens']} | paged > contiguous |",
    ]
    for r in (r3a, r3b):
        lines.append(
            f"| 3 | parallel sampling n={r['n']}, {r['prompts']} prompts x {r['max_tokens']} "
            "tokens: peak "
            f"blocks | shared {r['shared_peak_blocks']} vs independent "
            f"{r['independent_peak_blocks']}: **{pct(r['ratio'])}** | <= 60% |")
    lines.append(
        f"| 4 | beam search width {r4['width']}, {r4['prompts']} prompts x {r4['max_tokens']} "
        "tokens: peak "
        f"blocks | shared {r4['shared_peak_blocks']} vs independent "
        f"{r4['independent_peak_blocks']}: **{pct(r4['ratio'])}** | <= 45% |")
    lines.append(
        f"| 5 | prefix caching, {r5['requests']} x ({r5['system_len']} shared + "
        f"{r5['question_len']}) tokens | prompt tokens computed {r5['prefill_tokens_on']} (on) vs "
        f"{r5['prefill_tokens_off']} (off); TTFT mean {r5['ttft_mean_s_on']:.2f} s vs "
        f"{r5['ttft_mean_s_off']:.2f} s; **{pct(r5['prefix_served_from_cache'])}** of the shared "
        f"prefix from cache; outputs identical: {r5['outputs_identical']} | >= 90%, identical |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedllm bench memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    p.add_argument("--workload", default="seed20")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--pool-blocks", type=int, default=3000, help="pool of rows 1, 3, 4, 5")
    p.add_argument("--budget-blocks", type=int, default=256, help="fixed budget of row 2")
    p.add_argument("--sample-max-tokens", type=int, default=64)
    p.add_argument("--beam-width", type=int, default=5)
    p.add_argument("--beam-max-tokens", type=int, default=64)
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--prefix-max-tokens", type=int, default=16)
    p.add_argument("--json-out", default=None)
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    from pagedllm import LLM, SamplingParams

    common = dict(block_size=args.block_size, max_model_len=args.max_model_len)
    make: Callable[..., Any] = lambda **kw: LLM(args.model, **common, **kw)  # noqa: E731
    llm = make(num_kv_blocks=args.pool_blocks)
    vocab = llm.llm_engine.hf_config.vocab_size
    reqs = load_workload(args.workload, vocab, seed=args.seed)
    warm = SamplingParams(max_tokens=2)
    llm.generate({"prompt_token_ids": reqs[0].prompt_token_ids}, warm, use_tqdm=False)

    t0 = time.perf_counter()
    rows = [waste_row(llm, reqs, args.max_model_len)]
    budget_llm = make(num_kv_blocks=args.budget_blocks)
    rows.append(concurrency_row(budget_llm, reqs, args.max_model_len))
    del budget_llm
    for n in (4, 8):
        rows.append(parallel_sampling_row(llm, reqs, n, args.sample_max_tokens))
    rows.append(beam_row(llm, reqs, args.beam_width, args.beam_max_tokens))
    llm_off = make(num_kv_blocks=args.pool_blocks, enable_prefix_caching=False)
    llm_off.generate({"prompt_token_ids": reqs[0].prompt_token_ids}, warm, use_tqdm=False)
    rows.append(prefix_row(llm, llm_off, vocab, args.prefix_requests, args.system_len,
                           args.question_len, args.prefix_max_tokens, args.seed))
    total = time.perf_counter() - t0

    print(markdown_table(rows))
    print(f"(measured in {total:.0f} s: python -m benchmarks.memory "
          f"{' '.join(argv if argv is not None else sys.argv[1:])})")
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "total_s": total, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

"""Where a served run's time goes: `pagedllm serve` under load with both of its processes (the
API front end and the engine core) sampled by py-spy, their CPU seconds counted, and the same
prompts run offline at the same `max_num_seqs` for the served / offline ratio.

The load is issue 61's: random prompts of 256 tokens, 128 output tokens each with EOS ignored,
`--num-prompts` (160) with `--concurrency` (16) in flight, streamed `/v1/completions`.

Printed: served and offline output tok/s and their ratio, TTFT / ITL percentiles, CPU seconds
of each process (and per request for the API process; the core's as cores kept busy), the
engine's steps and tokens per step (/metrics), and for each process the functions
holding the most samples (self and inclusive, py-spy's `--idle` off: only time on a CPU or
waiting in native code counts). The raw collapsed stacks go to `--out DIR` for flame graphs.

    flock /tmp/pagedllm-cpu.lock .venv/bin/python -m benchmarks.serve_profile [--out DIR] [-- SERVE ARGS]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import time

import httpx
import psutil

from benchmarks.serve_process import serving
from benchmarks.serving import run_rate
from benchmarks.workloads import BenchRequest


def requests(n: int, prompt_len: int, output_len: int, vocab: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(100, vocab) for _ in range(prompt_len)], output_len) for _ in range(n)]


def top_functions(collapsed: str, n: int = 15) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """(self, inclusive) shares of the samples per function, from py-spy's collapsed stacks."""
    self_counts: collections.Counter = collections.Counter()
    incl_counts: collections.Counter = collections.Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        total += c
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")" if " (" in f else f
                  for f in stack.split(";")]
        self_counts[frames[-1]] += c
        for f in set(frames):
            incl_counts[f] += c
    share = lambda counter: [(f, round(100 * c / max(total, 1), 1)) for f, c in counter.most_common(n)]  # noqa: E731
    return share(self_counts), share(incl_counts)


def step_counters(base: str) -> dict[str, float]:
    """The engine's step counters from /metrics: steps (`vllm:iteration_tokens_total` count), the
    tokens they ran, preemptions."""
    out = {"steps": 0.0, "step_tokens": 0.0, "preemptions": 0.0}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("vllm:iteration_tokens_total_count"):
            out["steps"] += float(value)
        elif name.startswith("vllm:iteration_tokens_total_sum"):
            out["step_tokens"] += float(value)
        elif name.startswith("vllm:num_preemptions_total"):
            out["preemptions"] += float(value)
    return out


def offline_tok_s(reqs: list[BenchRequest], max_num_seqs: int) -> float:
    code = r'''
import json, sys, time
from pagedllm import LLM, SamplingParams
reqs = json.loads(sys.stdin.read()); n = int(sys.argv[1])
llm = LLM(max_num_seqs=n, max_model_len=2048)
prompts = [{"prompt_token_ids": r[0]} for r in reqs]
params = [SamplingParams(temperature=0, max_tokens=r[1], ignore_eos=True) for r in reqs]
llm.generate(prompts[:2], params[:2], use_tqdm=False)
t = time.perf_counter(); outs = llm.generate(prompts, params, use_tqdm=False); dt = time.perf_counter() - t
print(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
'''
    out = subprocess.run([sys.executable, "-c", code, str(max_num_seqs)], input=json.dumps(
        [[r.prompt_token_ids, r.max_tokens] for r in reqs]), capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=16, help="offline's; pass the server's after --")
    p.add_argument("--out", default="benchmarks/results/profile")
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--no-spy", action="store_true", help="no sampling (py-spy itself takes CPU)")
    p.add_argument("--renice-api", type=int, default=0, help="experiment: the API process's nice value")
    p.add_argument("serve_args", nargs="*")
    args = p.parse_args()
    if shutil.which("py-spy") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "py-spy")):
        sys.exit("py-spy is not installed: pip install py-spy")
    py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    reqs = requests(args.num_prompts, args.prompt_len, args.output_len, 49152, seed=7)
    os.makedirs(args.out, exist_ok=True)
    with serving(args.serve_args or ["--max-model-len", "2048"]) as base:
        port = int(base.rsplit(":", 1)[1])
        api = next(c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port
                   and c.status == psutil.CONN_LISTEN)
        api_proc = psutil.Process(api)
        core_proc = max(api_proc.children(recursive=True), key=lambda c: c.memory_info().rss)  # the model holder
        if args.renice_api:
            api_proc.nice(args.renice_api)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        asyncio.run(run_rate(base, model, reqs[:4], float("inf"), 4, 0, None))  # warm-up
        spies = {} if args.no_spy else {name: subprocess.Popen([py_spy, "record", "--pid", str(proc.pid), "--rate", "100", "--format", "raw",
                                         "--output", os.path.join(args.out, f"{name}.collapsed"), "--nonblocking"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for name, proc in (("api", api_proc), ("core", core_proc))}
        time.sleep(1.0)
        steps0 = step_counters(base)
        cpu0 = {n: sum(pr.cpu_times()[:2]) for n, pr in (("api", api_proc), ("core", core_proc))}
        t0 = time.perf_counter()
        served = asyncio.run(run_rate(base, model, reqs, float("inf"), args.concurrency, 0, None))
        wall = time.perf_counter() - t0
        cpu = {n: round(sum(pr.cpu_times()[:2]) - cpu0[n], 2) for n, pr in (("api", api_proc), ("core", core_proc))}
        steps = {k: v - steps0[k] for k, v in step_counters(base).items()}
        for spy in spies.values():
            spy.send_signal(2)  # SIGINT: py-spy writes its file and exits
        for spy in spies.values():
            spy.wait(60)
    result = {"served_out_tok_s": served["output_tokens_per_s"], "ttft_ms": served["ttft_ms"],
              "itl_ms": served["itl_ms"], "failed": served["failed"], "wall_s": round(wall, 1),
              "cpu_s": cpu, "api_cpu_ms_per_request": round(1000 * cpu["api"] / args.num_prompts, 1),
              "core_cores_busy": round(cpu["core"] / wall, 2), "steps": int(steps["steps"]),
              "tokens_per_step": round(steps["step_tokens"] / max(steps["steps"], 1), 1),
              "preemptions": int(steps["preemptions"])}
    if not args.no_offline:
        off = offline_tok_s(reqs, args.max_num_seqs)
        result["offline_out_tok_s"] = round(off, 1)
        result["served_over_offline"] = round(served["output_tokens_per_s"] / off, 3)
    print(json.dumps(result))
    for name in ("api", "core"):
        path = os.path.join(args.out, f"{name}.collapsed")
        if not os.path.exists(path):
            print(f"{name}: no profile written")
            continue
        self_top, incl_top = top_functions(open(path).read())
        print(f"\n## {name} process: self time (% of samples)")
        for f, s in self_top:
            print(f"  {s:5.1f}%  {f}")
        print(f"## {name} process: inclusive")
        for f, s in incl_top:
            print(f"  {s:5.1f}%  {f}")


if __name__ == "__main__":
    main()

"""One GGUF file end to end: pagedllm beside llama.cpp and ik_llama.cpp, every engine in one run.

pagedllm (default exact, `quant_compute=int8`, and with `--avx2` the exact path forced to the
x86-64-v3 kernels): one stream (32-token prompt, 128 tokens, greedy, ignore_eos), a 512-token
prompt's time to the first token (a new prompt each time: no prefix-cache hit), peak RSS; medians
of 3, each configuration in a fresh process. llama.cpp (built once from the llama-cpp-python sdist
by `benchmarks/peers.py`) and ik_llama.cpp (`--ik-llama-bench PATH`, plain and `-rtr 1`):
`llama-bench -t <threads> -p 512 -n 128 -r 3`. The weight-streaming floor is the file's bytes read
once per token at the read bandwidth measured in the same run. `--concurrent 20` adds 20 streaming
requests at once against `pagedllm serve` and llama.cpp's `llama-server -np 20` (continuous
batching), the same client for both.

    python -m benchmarks.gguf_e2e FILE.gguf [--ik-llama-bench PATH] [--avx2] [--concurrent 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys

import httpx

from benchmarks import peers
from benchmarks.serve_process import serving
from benchmarks.serving import run_rate
from benchmarks.workloads import BenchRequest

CHILD = r'''
import json, resource, sys, time
from pagedllm import LLM, SamplingParams
path, compute, kv = sys.argv[1], sys.argv[2], float(sys.argv[3])
t0 = time.time()
llm = LLM(model=path, max_model_len=4096, quant_compute=compute, kv_cache_space=kv)
load = time.time() - t0
ids = [{"prompt_token_ids": list(range(100, 132))}]
llm.generate(ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
rates, ttft = [], []
for _ in range(3):
    t0 = time.time()
    llm.generate(ids, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    rates.append(128 / (time.time() - t0))
for r in range(3):
    prompt = [{"prompt_token_ids": [100 + (i * 7 + r * 13 + 1) % 40000 for i in range(512)]}]
    t0 = time.time()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    ttft.append(time.time() - t0)
rates.sort(); ttft.sort()
print(json.dumps({"compute": compute, "load_s": load, "tg128": rates[1], "pp512": 512 / ttft[1],
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))
'''

BANDWIDTH = r'''
import statistics, time, torch
torch.set_num_threads(int(__import__("sys").argv[1]))
big = torch.ones(1 << 28); big.sum(); times = []
for _ in range(5):
    t0 = time.perf_counter(); big.sum(); times.append(time.perf_counter() - t0)
print(big.numel() * 4 / statistics.median(times) / 1e9)
'''


def run_pagedllm(path: str, compute: str, kv: float, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, path, compute, str(kv)], capture_output=True, text=True,
                         check=True, env={**os.environ, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_llama_bench(binary: str, path: str, threads: int, extra: tuple[str, ...] = ()) -> dict:
    out = subprocess.run([binary, "-m", path, "-t", str(threads), "-p", "512", "-n", "128", "-r", "3", "-o", "json",
                          *extra], capture_output=True, text=True, check=True).stdout
    result = {}
    for row in json.loads(out):
        key = "pp512" if row.get("n_prompt") == 512 and row.get("n_gen") == 0 else "tg128"
        result[key] = row["avg_ts"]
    return result


def read_bandwidth_gbs(threads: int) -> float:
    """GB/s of a `threads`-thread read of 1 GiB, median of 5 (a fresh process: nothing else resident)."""
    out = subprocess.run([sys.executable, "-c", BANDWIDTH, str(threads)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def concurrent_tok_s(command: list[str], args: list[str], n: int) -> dict:
    """Output tok/s of `n` streaming requests sent at once (64-token prompts, 128 tokens each, greedy)."""
    reqs = [BenchRequest(prompt_token_ids=[100 + (i * 31 + j * 7) % 30000 for j in range(64)], max_tokens=128)
            for i in range(n)]
    with serving(args, timeout=600, command=command) as base:
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        asyncio.run(run_rate(base, model, reqs[:2], float("inf"), n, 0, None))  # warm-up
        return asyncio.run(run_rate(base, model, reqs, float("inf"), n, 0, None))


def cpu_line() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                 platform.processor())
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16") if f in flags]
    return f"{model}; {os.cpu_count()} cores; {' '.join(isa)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench (default: built by benchmarks.peers)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    p.add_argument("--ik-llama-bench", default=None, help="ik_llama.cpp's llama-bench (not on PyPI: build it yourself)")
    p.add_argument("--avx2", action="store_true", help="also pagedllm with PAGEDLLM_KERNEL_MARCH=x86-64-v3")
    p.add_argument("--concurrent", type=int, default=0, help="N requests at once: pagedllm serve vs llama-server")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-space", type=float, default=0.11, help="GiB of KV cache (4096 tokens of a 1.5B Qwen2: 0.11)")
    args = p.parse_args()
    size_gb = os.path.getsize(args.path) / 1e9
    gbs = read_bandwidth_gbs(args.threads)
    floor = gbs / size_gb
    print(f"CPU: {cpu_line()}\nfile {args.path}: {size_gb:.3f} GB; read bandwidth {gbs:.1f} GB/s -> "
          f"weight-streaming floor {floor:.2f} tok/s\n")
    llama_bins = None if args.no_llama_cpp else (
        {"llama-bench": args.llama_bench} if args.llama_bench else peers.llama_cpp_binaries())
    rows: list[tuple[str, dict]] = []
    if llama_bins:
        rows.append((f"llama.cpp (llama-cpp-python {peers.LLAMA_CPP_PYTHON})",
                     run_llama_bench(llama_bins["llama-bench"], args.path, args.threads)))
    if args.ik_llama_bench:
        rows.append(("ik_llama.cpp", run_llama_bench(args.ik_llama_bench, args.path, args.threads)))
        rows.append(("ik_llama.cpp -rtr 1", run_llama_bench(args.ik_llama_bench, args.path, args.threads,
                                                            ("-rtr", "1"))))
    configs = [("pagedllm default (exact)", "exact", None), ("pagedllm quant_compute=int8", "int8", None)]
    if args.avx2:
        configs.append(("pagedllm default, x86-64-v3 kernels", "exact", {"PAGEDLLM_KERNEL_MARCH": "x86-64-v3"}))
    for name, compute, env in configs:
        rows.append((name, run_pagedllm(args.path, compute, args.kv_cache_space, env)))
    peer_rows = [r for name, r in rows if not name.startswith("pagedllm")]
    best_tg = max((r["tg128"] for r in peer_rows), default=None)
    best_pp = max((r["pp512"] for r in peer_rows), default=None)
    print("| engine | tg128 tok/s | % of floor | pp512 tok/s | tg vs best peer | pp vs best peer | load s | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        vs = (f"{r['tg128'] / best_tg:.2f}x | {r['pp512'] / best_pp:.2f}x" if best_tg else "- | -")
        extra = f"{r['load_s']:.1f} | {r['peak_rss_gb']:.2f}" if "load_s" in r else "- | -"
        print(f"| {name} | {r['tg128']:.2f} | {100 * r['tg128'] / floor:.0f}% | {r['pp512']:.1f} | {vs} | {extra} |",
              flush=True)
    if args.concurrent:
        n = args.concurrent
        ctx = n * 256
        print(f"\n{n} streaming requests at once (64-token prompts, 128 tokens each):")
        ours = concurrent_tok_s([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve"],
                                [args.path, "--max-model-len", "4096", "--max-num-seqs", str(n)], n)
        print(f"| pagedllm serve | {ours['output_tokens_per_s']:.1f} out tok/s | failed {ours['failed']} |", flush=True)
        if llama_bins and "llama-server" in llama_bins:
            theirs = concurrent_tok_s([llama_bins["llama-server"]], ["-m", args.path, "-t", str(args.threads),
                                      "-np", str(n), "-c", str(ctx), "--host", "127.0.0.1"], n)
            print(f"| llama-server -np {n} | {theirs['output_tokens_per_s']:.1f} out tok/s | failed {theirs['failed']} |")
            print(f"ratio pagedllm / llama-server: {ours['output_tokens_per_s'] / theirs['output_tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()

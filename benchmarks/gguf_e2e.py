"""One GGUF file end to end: pagedllm (exact and int8) against llama.cpp's `llama-bench`, same run.

pagedllm: load time, one stream (32-token prompt, 128 tokens, greedy, ignore_eos), time to first
token of a 512-token prompt (a new prompt each time: no prefix-cache hit), peak RSS of the
process; medians of 3. llama.cpp: `llama-bench -t <threads> -p 512 -n 128 -r 3` on the same file
(pp512, tg128), when `--llama-bench` names the binary. Each configuration runs in a fresh process.

    python -m benchmarks.gguf_e2e FILE.gguf [--llama-bench PATH] [--kv-cache-space 0.11]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

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


def run_pagedllm(path: str, compute: str, kv: float) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, path, compute, str(kv)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_llama_bench(binary: str, path: str, threads: int) -> dict:
    out = subprocess.run([binary, "-m", path, "-t", str(threads), "-p", "512", "-n", "128", "-r", "3", "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    result = {}
    for row in rows:
        key = "pp512" if row.get("n_prompt") == 512 and row.get("n_gen") == 0 else "tg128"
        result[key] = row["avg_ts"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("path")
    p.add_argument("--llama-bench", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-space", type=float, default=0.11, help="GiB of KV cache (4096 tokens of a 1.5B Qwen2: 0.11)")
    args = p.parse_args()
    size_gb = __import__("os").path.getsize(args.path) / 1e9
    base = run_llama_bench(args.llama_bench, args.path, args.threads) if args.llama_bench else None
    print(f"file {args.path}: {size_gb:.3f} GB" + (f"; llama.cpp pp512 {base['pp512']:.1f} tok/s, tg128 {base['tg128']:.2f} tok/s" if base else ""))
    print("| pagedllm | load s | tg128 tok/s | pp512 tok/s | peak RSS GB (KV %.2f GiB) |" % args.kv_cache_space
          + (" tg vs llama.cpp | pp vs llama.cpp |" if base else ""))
    for compute in ("exact", "int8"):
        r = run_pagedllm(args.path, compute, args.kv_cache_space)
        cells = f"| {compute} | {r['load_s']:.1f} | {r['tg128']:.2f} | {r['pp512']:.1f} | {r['peak_rss_gb']:.2f} |"
        if base:
            cells += f" {r['tg128'] / base['tg128']:.2f}x | {r['pp512'] / base['pp512']:.2f}x |"
        print(cells, flush=True)


if __name__ == "__main__":
    main()

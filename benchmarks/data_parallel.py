"""Served throughput with --data-parallel-size 1 and 2 (default model, float32, 2 GiB KV per
replica): seed20 and burst200 all at once, one warm-up run then the median of 3.

    flock /tmp/pagedllm-cpu.lock python -m benchmarks.data_parallel
"""
import asyncio, os, subprocess, sys, time, httpx, statistics
from benchmarks.serving import run_rate
from benchmarks.workloads import load_workload
for dp in ("1", "2"):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", "8313",
                          "--max-model-len", "2048", "--kv-cache-space", "2", "--data-parallel-size", dp,
                          "--uvicorn-log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        try:
            if httpx.get("http://127.0.0.1:8313/health").status_code == 200: break
        except Exception: pass
        time.sleep(0.3)
    for w in ("seed20", "burst200"):
        reqs = load_workload(w, 49152, seed=0)
        runs = [asyncio.run(run_rate("http://127.0.0.1:8313", "SmolLM2-135M-Instruct", reqs, float("inf"), 256, 0, None)) for _ in range(4)][1:]
        print("dp", dp, w, [r["output_tokens_per_s"] for r in runs], "median", statistics.median(r["output_tokens_per_s"] for r in runs),
              "itl p50", statistics.median(r["itl_ms"]["median"] for r in runs), flush=True)
    p.terminate(); p.wait()

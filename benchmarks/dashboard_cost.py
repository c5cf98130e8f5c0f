"""What an open dashboard costs the engine: served throughput of seed20 with a poller of
/v1/internal/engine_state at the page's rate (500 ms) and without, on one server.

One server (`pagedllm serve`, the default model, float32); one warm-up run; then runs
alternate without / with the poller (ABAB..., so that a drift of the machine's load falls on
both), `--repeats` of each; the medians of output tokens/s are compared (goal: with >= 98%
of without). The poller is what the page does: one GET every 500 ms with the Bearer key, and
each answer decoded; it also records the endpoint's round-trip time.

    flock /tmp/pagedllm-cpu.lock python -m benchmarks.dashboard_cost \\
        --json-out benchmarks/results/dashboard_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import httpx

from benchmarks.serving import run_rate
from benchmarks.workloads import load_workload

MODEL = "SmolLM2-135M-Instruct"
KEY = "dashboard-cost"


async def _poll(url: str, interval_s: float, stop: asyncio.Event, times: list[float],
                sizes: list[int], builds: list[float]) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=30.0) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            resp = await client.get(url + "/v1/internal/engine_state", headers=headers)
            resp.raise_for_status()
            sizes.append(len(resp.content))
            builds += [e["build_ms"] for e in resp.json()["engines"] if "build_ms" in e]
            times.append(time.perf_counter() - t0)
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass


async def _run(url: str, reqs, with_dashboard: bool, interval_s: float) -> dict:
    stop = asyncio.Event()
    times: list[float] = []
    sizes: list[int] = []
    builds: list[float] = []
    poller = (asyncio.create_task(_poll(url, interval_s, stop, times, sizes, builds))
              if with_dashboard else None)
    result = await run_rate(url, MODEL, reqs, float("inf"), 256, 0, KEY)
    stop.set()
    if poller is not None:
        await poller
        result["polls"] = len(times)
        result["poll_ms_median"] = round(statistics.median(times) * 1000, 2)
        result["poll_ms_max"] = round(max(times) * 1000, 2)
        result["poll_bytes_median"] = int(statistics.median(sizes))
        if builds:  # the core's time per snapshot (engine_state's build_ms)
            result["poll_build_ms_median"] = round(statistics.median(builds), 3)
            result["poll_build_ms_max"] = round(max(builds), 3)
    return result


def _start_server(port: int, kv_gib: float) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port),
         "--max-model-len", "2048", "--kv-cache-space", str(kv_gib), "--api-key", KEY,
         "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not start")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="seed20")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--interval-ms", type=int, default=500, help="the page's poll interval")
    ap.add_argument("--kv-cache-space", type=float, default=2.0)
    ap.add_argument("--port", type=int, default=8329)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    reqs = load_workload(args.workload, 49152, seed=0)
    proc = _start_server(args.port, args.kv_cache_space)
    try:
        asyncio.run(_run(url, reqs, False, 0))  # warm-up
        runs: dict[str, list[dict]] = {"without": [], "with": []}
        for _ in range(args.repeats):
            for name in ("without", "with"):
                r = asyncio.run(_run(url, reqs, name == "with", args.interval_ms / 1000))
                assert r["failed"] == 0, r
                runs[name].append(r)
                print(name, r["output_tokens_per_s"], {k: r[k] for k in r if k.startswith("poll")},
                      flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    med = {k: statistics.median(r["output_tokens_per_s"] for r in v) for k, v in runs.items()}
    out = {
        "workload": args.workload, "repeats": args.repeats, "interval_ms": args.interval_ms,
        "cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(),
        "output_tokens_per_s": {k: [r["output_tokens_per_s"] for r in v] for k, v in runs.items()},
        "median_without": med["without"], "median_with": med["with"],
        "ratio": round(med["with"] / med["without"], 4),
        # each "with" run over the "without" run just before it: the pairs share the machine's
        # load of the moment (other jobs on a shared machine move single runs by 2x)
        "pair_ratios": [round(w["output_tokens_per_s"] / o["output_tokens_per_s"], 4)
                        for o, w in zip(runs["without"], runs["with"])],
        "polls": [r.get("polls") for r in runs["with"]],
        "poll_ms_median": [r.get("poll_ms_median") for r in runs["with"]],
        "poll_bytes_median": [r.get("poll_bytes_median") for r in runs["with"]],
        "poll_build_ms_median": [r.get("poll_build_ms_median") for r in runs["with"]],
        "poll_build_ms_max": [r.get("poll_build_ms_max") for r in runs["with"]],
    }
    out["median_pair_ratio"] = statistics.median(out["pair_ratios"])
    print(json.dumps(out, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()

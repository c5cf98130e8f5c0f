"""Online serving benchmark against any OpenAI-compatible server (ours, vLLM's, llama.cpp's).

    python -m benchmarks.serving --base-url http://127.0.0.1:8000 --workload seed20 \
        --request-rate inf,4,1 --max-concurrency 64 --plot benchmarks/results/plots

Requests arrive as a Poisson process at `--request-rate` per second (`inf`: all at once),
with at most `--max-concurrency` in flight. Each streams `/v1/completions` with its prompt's
token ids, greedy, EOS ignored, exactly `max_tokens` tokens. Reported per rate: time to first
token (TTFT), time per output token after the first (TPOT), inter-token latency (ITL) and
end-to-end latency (mean, median, p99), and request / output-token throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.workloads import BenchRequest, load_dataset, load_workload


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


async def _one_request(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest,
                       headers: dict) -> RequestResult:
    prompt = req.prompt if req.prompt is not None else req.prompt_token_ids
    body = {"model": model, "prompt": prompt, "max_tokens": req.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    res = RequestResult(ok=False, prompt_len=len(req.prompt_token_ids))
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                usage = payload.get("usage") or {}
                if usage.get("completion_tokens"):
                    res.output_tokens = usage["completion_tokens"]
                if usage.get("prompt_tokens"):
                    res.prompt_len = usage["prompt_tokens"]
                choices = payload.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
                chunks += 1
        res.e2e = time.perf_counter() - start
        if not res.output_tokens:
            res.output_tokens = chunks
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = repr(exc)
    return res


async def run_rate(base_url: str, model: str, reqs: list[BenchRequest], rate: float,
                   max_concurrency: int, seed: int, api_key: str | None) -> dict:
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(max_concurrency)
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max_concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        async def limited(req: BenchRequest) -> RequestResult:
            async with sem:
                return await _one_request(client, url, model, req, headers)

        tasks = []
        start = time.perf_counter()
        for req in reqs:
            tasks.append(asyncio.create_task(limited(req)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, rate)


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    s = sorted(xs)
    p99 = s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]
    return {"mean": round(statistics.fmean(s) * 1000, 2),
            "median": round(statistics.median(s) * 1000, 2), "p99": round(p99 * 1000, 2)}


def summarize(results: list[RequestResult], duration: float, rate: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "request_rate": "inf" if not math.isfinite(rate) else rate,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": round(duration, 2),
        "output_tokens": out_tokens,
        "requests_per_s": round(len(ok) / duration, 3),
        "output_tokens_per_s": round(out_tokens / duration, 2),
        "total_tokens_per_s": round((out_tokens + sum(r.prompt_len for r in ok)) / duration, 2),
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([x for r in ok for x in r.itls]),
        "e2e_ms": _stats([r.e2e for r in ok]),
    }


def markdown_table(rows: list[dict]) -> str:
    lines = ["| rate | done | out tok/s | req/s | TTFT ms mean/med/p99 | TPOT ms mean/med/p99 | "
             "ITL ms med/p99 | E2E ms med/p99 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, p, i, e = r["ttft_ms"], r["tpot_ms"], r["itl_ms"], r["e2e_ms"]
        lines.append(f"| {r['request_rate']} | {r['completed']}/{r['completed'] + r['failed']} | "
                     f"{r['output_tokens_per_s']} | {r['requests_per_s']} | "
                     f"{t['mean']}/{t['median']}/{t['p99']} | {p['mean']}/{p['median']}/{p['p99']} | "
                     f"{i['median']}/{i['p99']} | {e['median']}/{e['p99']} |")
    return "\n".join(lines)


def plot(rows: list[dict], out_dir: str, label: str) -> list[str]:
    """Latency percentiles vs request rate, and a throughput bar chart (PNG files)."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    names = [str(r["request_rate"]) for r in rows]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, title in zip(axes, ["ttft_ms", "tpot_ms", "e2e_ms"], ["TTFT", "TPOT", "E2E"]):
        for pct in ["mean", "median", "p99"]:
            ax.plot(names, [r[key][pct] for r in rows], marker="o", label=pct)
        ax.set_title(f"{title} (ms) vs request rate")
        ax.set_xlabel("requests/s")
        ax.legend()
    fig.suptitle(label)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "latency_vs_rate.png"))
    fig.savefig(paths[-1])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(names, [r["output_tokens_per_s"] for r in rows])
    ax.set_xlabel("requests/s")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Throughput: {label}")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "throughput.png"))
    fig.savefig(paths[-1])
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", default="seed20")
    p.add_argument("--dataset", default=None)
    p.add_argument("--vocab-size", type=int, default=49152, help="for random-token workloads")
    p.add_argument("--request-rate", default="inf", help="comma-separated rates; 'inf' = burst")
    p.add_argument("--max-concurrency", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="folder for PNG charts")
    p.add_argument("--json-out", default=None)
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    model = args.model
    if model is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        models = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers,
                           timeout=30).json()
        model = models["data"][0]["id"]
    reqs = (load_dataset(args.dataset) if args.dataset
            else load_workload(args.workload, args.vocab_size, seed=args.seed))
    rows = []
    for rate_s in args.request_rate.split(","):
        rate = float(rate_s)
        row = asyncio.run(run_rate(args.base_url, model, reqs, rate, args.max_concurrency,
                                   args.seed, args.api_key))
        row["workload"] = args.dataset or args.workload
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(markdown_table(rows))
    if args.json_out:
        with open(args.json_out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if args.plot:
        for path in plot(rows, args.plot, f"{model} / {args.dataset or args.workload}"):
            print("wrote", path)
    return rows


if __name__ == "__main__":
    main()

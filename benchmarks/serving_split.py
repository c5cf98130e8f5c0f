"""The server against the offline engine, before and after the process split, in one run.

    flock /tmp/pagedllm-cpu.lock python -m benchmarks.serving_split --before 9d6b94b \
        --after HEAD --repeats 3

Modes (each a `pagedllm serve` started from its own source tree, default model, float32):
- `before`: a git worktree at `--before` (the commit before the split: the engine in a thread
  of the API server process);
- `split`: this tree (the engine core in its own process, ZeroMQ);
- `inproc`: this tree with PAGEDLLM_ENGINE_IN_PROCESS=1 (the same core in a thread).
For each: `seed20` and `burst200` all at once, and `burst200` with Poisson arrivals at
`--rate` per second and at most 32 in flight (benchmarks/serving.py: streaming
/v1/completions with token-id prompts). The offline engine (benchmarks/throughput.py) runs the
same two workloads first. Medians of `--repeats` runs after one start-up and `--warmup`
untimed runs; ratios are server output tok/s over offline output tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.serving import run_rate
from benchmarks.workloads import load_workload

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [("seed20", float("inf"), 256), ("burst200", float("inf"), 256),
          ("burst200", None, 32)]  # None: --rate


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline(root: Path, workload: str, repeats: int, warmup: int) -> float:
    """Median output tok/s of the offline engine (of the tree `root`) on `workload`, over the
    runs after `warmup` untimed ones."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        out = f.name
    subprocess.run([sys.executable, "-m", "benchmarks.throughput", "--workload", workload,
                    "--repeats", str(repeats + warmup), "--json-out", out], cwd=root, check=True,
                   env=dict(os.environ, PYTHONPATH=str(root)), stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in Path(out).read_text().splitlines() if line.strip()]
    os.unlink(out)
    return statistics.median(rows[-1]["runs_output_tokens_per_s"][warmup:])


def worktree(commit: str) -> Path:
    path = Path(tempfile.gettempdir()) / f"pagedllm-{commit[:12]}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT,
                       check=True, stdout=subprocess.DEVNULL)
    return path


def serve(root: Path, env_extra: dict[str, str]) -> tuple[subprocess.Popen, str, float]:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(root), HF_HUB_OFFLINE="1", **env_extra)
    log = open(Path(tempfile.gettempdir()) / f"serving_split_{port}.log", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve",
                             "--port", str(port), "--max-model-len", "2048",
                             "--uvicorn-log-level", "warning"],
                            cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server from {root} exited; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)


def run_mode(name: str, root: Path, env_extra: dict, rate: float, repeats: int,
             warmup: int) -> list[dict]:
    proc, url, startup = serve(root, env_extra)
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    rows = []
    try:
        for workload, shape_rate, conc in SHAPES:
            r = rate if shape_rate is None else shape_rate
            reqs = load_workload(workload, 49152, seed=0)
            runs = [asyncio.run(run_rate(url, model, reqs, r, conc, 0, None))
                    for _ in range(warmup + repeats)][warmup:]
            med = statistics.median
            rows.append({
                "mode": name, "workload": workload, "rate": "inf" if r == float("inf") else r,
                "max_concurrency": conc, "startup_s": round(startup, 1),
                "failed": sum(x["failed"] for x in runs),
                "output_tokens_per_s": med(x["output_tokens_per_s"] for x in runs),
                "runs_tok_s": [x["output_tokens_per_s"] for x in runs],
                "ttft_p50_ms": med(x["ttft_ms"]["median"] for x in runs),
                "ttft_p99_ms": med(x["ttft_ms"]["p99"] for x in runs),
                "itl_p50_ms": med(x["itl_ms"]["median"] for x in runs),
                "itl_p99_ms": med(x["itl_ms"]["p99"] for x in runs),
            })
            print(json.dumps(rows[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", default=None, help="commit of the 'before' server (omit: skip)")
    p.add_argument("--after", default=None,
                   help="commit of the 'split' / 'inproc' servers and the offline engine "
                        "(default: this tree as it is)")
    p.add_argument("--modes", default="before,split,inproc")
    p.add_argument("--rate", type=float, default=8.0, help="Poisson rate of the 32-in-flight run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed runs of each shape first (the first run after start-up "
                        "touches the KV cache's pages: 20-35%% slower, offline and served)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    after = worktree(args.after) if args.after else ROOT
    base = {w: offline(after, w, args.repeats, args.warmup) for w in ("seed20", "burst200")}
    print(json.dumps({"offline_output_tokens_per_s": base}), flush=True)
    rows = []
    for mode in args.modes.split(","):
        if mode == "before":
            if not args.before:
                continue
            rows += run_mode("before", worktree(args.before), {}, args.rate, args.repeats, args.warmup)
        elif mode == "split":
            rows += run_mode("split", after, {}, args.rate, args.repeats, args.warmup)
        elif mode == "inproc":
            rows += run_mode("inproc", after, {"PAGEDLLM_ENGINE_IN_PROCESS": "1"}, args.rate,
                             args.repeats, args.warmup)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    print(f"\noffline engine: seed20 {base['seed20']} tok/s, burst200 {base['burst200']} tok/s\n")
    print("| mode | workload | rate | in flight | out tok/s | of offline | TTFT p50/p99 ms | "
          "ITL p50/p99 ms | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["output_tokens_per_s"] / base[r["workload"]]
        print(f"| {r['mode']} | {r['workload']} | {r['rate']} | {r['max_concurrency']} | "
              f"{r['output_tokens_per_s']} | {ratio:.2f} | {r['ttft_p50_ms']}/{r['ttft_p99_ms']} | "
              f"{r['itl_p50_ms']}/{r['itl_p99_ms']} | {r['failed']} |")
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(json.dumps({"offline": base, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()

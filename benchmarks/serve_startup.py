"""Start-up to first token of `pagedllm serve` on the default model (warm caches: the model file,
converted tokenizer and built kernels already on disk, as on every start after the first).

    python -m benchmarks.serve_startup --repeats 3 [-- extra serve args]

Each run starts a fresh `pagedllm serve` (the engine core in its own process, as users run it),
polls /health, then streams one completion and stops at its first token. Prints, per run and as
medians: seconds to /health answering 200, and to the first streamed token.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(extra: list[str]) -> dict:
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"pagedllm serve exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.05)
        health = time.perf_counter() - t0
        models = json.load(urllib.request.urlopen(f"{base}/v1/models", timeout=10))
        body = json.dumps({"model": models["data"][0]["id"], "prompt": "Hello", "max_tokens": 4,
                           "stream": True}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: ") and b'"text"' in line:
                    break
        first = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"health_s": round(health, 2), "first_token_s": round(first, 2)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("serve_args", nargs="*", help="extra arguments of `pagedllm serve` (after --)")
    args = p.parse_args(argv)
    one_start(args.serve_args)  # warm: the model file, tokenizer and kernels on disk
    runs = [one_start(args.serve_args) for _ in range(args.repeats)]
    result = {"runs": runs,
              "median_health_s": statistics.median(r["health_s"] for r in runs),
              "median_first_token_s": statistics.median(r["first_token_s"] for r in runs)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""Hostile probes against a real `pagedllm serve` (the engine core in its own process), as an
outsider would attack it (issue 23): each probe starts a fresh server from the source tree
given (so that one that hangs the server does not spoil the next), sends its hostile input,
then checks that a plain 2-token completion succeeds within 10 s and what `/health` says.

    flock /tmp/pagedllm-cpu.lock .venv/bin/python -m benchmarks.hostile_probes [--tree DIR] [--json OUT]

`--tree` runs the server from another checkout (e.g. a `git worktree` of an older commit) with
this virtual environment, to compare before and after.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

MODEL = "SmolLM2-135M-Instruct"
PLAIN = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tree: Path, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="probe-", suffix=".log", delete=False)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(tree))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--max-model-len", "512",
             "--kv-cache-space", "0.1", "--port", str(self.port), "--uvicorn-log-level",
             "warning", *extra], cwd=tree, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(Path(self.log.name).read_text()[-2000:])
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise RuntimeError("the server did not start")

    def post(self, path: str, body, timeout: float = 30.0, **kw) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=timeout, **kw)

    def after(self) -> dict:
        """A plain request within 10 s, and /health."""
        out: dict = {}
        t0 = time.monotonic()
        try:
            r = self.post("/v1/completions", PLAIN, timeout=10)
            out["plain"] = f"{r.status_code} in {time.monotonic() - t0:.2f} s"
        except httpx.TransportError as exc:
            out["plain"] = f"no answer in 10 s ({type(exc).__name__})"
        try:
            out["health"] = httpx.get(f"{self.url}/health", timeout=5).status_code
        except httpx.TransportError as exc:
            out["health"] = f"no answer in 5 s ({type(exc).__name__})"
        out["alive"] = self.proc.poll() is None
        return out

    def close(self) -> None:
        self.proc.kill()  # its core leaves with it (it polls its parent)
        self.proc.wait(10)
        time.sleep(1.5)
        os.unlink(self.log.name)


def _status(fn) -> str:
    t0 = time.monotonic()
    try:
        r = fn()
    except httpx.TransportError as exc:
        return f"no answer ({type(exc).__name__}) after {time.monotonic() - t0:.1f} s"
    msg = ""
    try:
        msg = r.json().get("error", {}).get("message", "")[:90]
    except Exception:
        pass
    return f"{r.status_code} in {time.monotonic() - t0:.2f} s {msg}".strip()


def probe_min_tokens(srv: Server) -> str:
    return _status(lambda: srv.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "min_tokens": 5000}))


def probe_best_of(srv: Server) -> str:
    return _status(lambda: srv.post("/v1/completions", {**PLAIN, "best_of": 1_000_000},
                                    timeout=20))


def probe_n(srv: Server) -> str:
    return _status(lambda: srv.post("/v1/completions", {**PLAIN, "n": 1000}, timeout=20))


def probe_seed(srv: Server) -> str:
    return _status(lambda: srv.post("/v1/completions", {**PLAIN, "seed": 2**64}))


def probe_logit_bias(srv: Server) -> str:
    r = srv.post("/v1/completions", {**PLAIN, "max_tokens": 3, "temperature": 1.0,
                                     "logit_bias": {"5": 1e30}, "logprobs": 1})
    if r.status_code != 200:
        return _status(lambda: r)
    toks = r.json()["choices"][0]["logprobs"]["tokens"]
    return f"200, tokens {toks}"


def probe_enum(srv: Server) -> str:
    enum = [f"item{i}" for i in range(100_000)]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "e", "schema": {"enum": enum}}}}
    # while it runs, how long does a plain request take?
    side: dict = {}

    def plain() -> None:
        time.sleep(1.0)
        side["plain during"] = _status(lambda: srv.post("/v1/completions", PLAIN, timeout=30))

    t = threading.Thread(target=plain)
    t.start()
    main = _status(lambda: srv.post("/v1/chat/completions", body, timeout=40))
    t.join()
    return f"{main}; plain request meanwhile: {side['plain during']}"


def _core_socket(which: str) -> str | None:
    """The newest server's core socket (`input` / `output`), as a same-user process finds it."""
    paths = sorted(glob.glob(f"{tempfile.gettempdir()}/pagedllm-core-*/core0-{which}"),
                   key=os.path.getmtime)
    return f"ipc://{paths[-1]}" if paths else None


def probe_output_garbage(srv: Server) -> str:
    """A same-user process pushes b"\\xc1garbage" to the core's output socket."""
    import zmq

    address = _core_socket("output")
    if address is None:
        return "no ipc socket found"
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(address)
    sent = True
    try:
        push.send(b"\xc1garbage", zmq.NOBLOCK)
    except zmq.Again:
        sent = False
    time.sleep(1.0)
    push.close(0)
    ctx.term()
    return "sent" if sent else "not sent (no peer accepted it)"


def probe_input_spy(srv: Server) -> str:
    """A same-user process connects a PULL socket to the core's input socket: does it receive
    other users' requests?"""
    import zmq

    address = _core_socket("input")
    if address is None:
        return "no ipc socket found"
    ctx = zmq.Context()
    spy = ctx.socket(zmq.PULL)
    spy.connect(address)
    time.sleep(0.5)
    results = []
    for i in range(4):
        try:
            results.append(srv.post("/v1/completions", {**PLAIN, "prompt": f"secret {i}"},
                                    timeout=5).status_code)
        except httpx.TransportError:
            results.append("timeout")
    got = 0
    while spy.poll(200):
        spy.recv_multipart()
        got += 1
    spy.close(0)
    ctx.term()
    return f"the spy received {got} of 4 requests; their statuses {results}"


PROBES = {
    "min_tokens 5000, no max_tokens (chat)": probe_min_tokens,
    "best_of 1000000": probe_best_of,
    "n 1000": probe_n,
    "seed 2**64": probe_seed,
    "logit_bias {5: 1e30}": probe_logit_bias,
    "json_schema enum of 100,000 strings": probe_enum,
    "PULL spy on the core's input socket": probe_input_spy,
    "b'\\xc1garbage' on the core's output socket": probe_output_garbage,
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for name, fn in PROBES.items():
        if args.only and not any(o in name for o in args.only):
            continue
        srv = Server(Path(args.tree), [])
        try:
            seen = fn(srv)
            after = srv.after()
        finally:
            srv.close()
        rows.append({"probe": name, "answer": seen, **after})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

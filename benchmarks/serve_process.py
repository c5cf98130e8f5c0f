"""A `pagedllm serve` process for benchmarks that talk to a real server: a free port, its output
discarded, its base URL once /health answers 200, stopped on leaving."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(args: list[str], timeout: float = 240.0, command: list[str] | None = None) -> Iterator[str]:
    """Run `pagedllm serve <args>` (or `command <args>`, e.g. llama.cpp's `llama-server`); yield
    "http://127.0.0.1:<port>" once its /health answers 200."""
    port = free_port()
    command = command or [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve"]
    proc = subprocess.Popen([*command, *args, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(command + args)} exited with {proc.returncode}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(command + args)}: not healthy in {timeout:.0f} s")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

"""What `pagedllm serve` does before it imports the HTTP stack: check the flags, bind the
port and launch the engine cores, so that the cores load the model while this process imports
FastAPI, torch and transformers and loads the tokenizer (about 3 s of a tiny model's 6 s
start-up on 2 cores were these imports, done before the cores were launched). Imports nothing
heavy; api_server.run_server takes what it made."""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.core_start import CoreStart, in_process_requested
from pagedllm.entrypoints.arg_utils import (
    engine_config_from_args,
    server_extras_from_args,
    validate_server_args,
)
from pagedllm.model.resolution import serving_runner


@dataclass
class ServeStart:
    """The bound listening socket and the cores already launched, a pooling model's too (None:
    the server launches them itself: an in-process core)."""

    sock: socket.socket
    cores: Any = None
    claimed: bool = False

    def claim(self) -> Any:
        """The cores, now the engine's to shut down."""
        self.claimed = True
        return self.cores

    def abandon(self) -> None:
        """Close the port and shut the cores down (the server stopped before taking them)."""
        self.sock.close()
        if self.cores is not None:
            self.cores.abandon()


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (not yet listen) so that a busy port is an error before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def start_serving(args: argparse.Namespace) -> ServeStart:
    """Check every flag, bind the port (a ValueError for either), launch the cores."""

    validate_server_args(args)
    config = engine_config_from_args(args)
    server_extras_from_args(args)
    serving_runner(config)  # an architecture no runner runs: a ValueError here, before any core
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {exc}") from exc
    if in_process_requested():
        return ServeStart(sock)
    try:
        return ServeStart(sock, CoreStart(config))
    except BaseException:
        sock.close()
        raise

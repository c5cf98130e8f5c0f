"""The link between rank 0 and each worker: a `multiprocessing.connection.Connection` over TCP
(length-prefixed pickles, HMAC challenge on connect with a random per-executor key).

Why not torch.distributed for the step message: a broadcast waits under the collective timeout,
so an idle server (no step for minutes) would time its workers out; a socket just blocks. Why
TCP and not a pipe: the same link serves workers on other machines (Ray). Rank 0 listens;
workers connect. Accepting has a deadline, so a worker that never comes is an error, not a hang.
"""

from __future__ import annotations

import secrets
import socket
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge


class Listener:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.authkey = secrets.token_bytes(32)
        self._sock = socket.create_server((host, 0), backlog=64)
        self.address = (host, self._sock.getsockname()[1])

    def accept(self, timeout_s: float) -> Connection | None:
        """One authenticated connection, or None when nobody connected within `timeout_s`."""
        self._sock.settimeout(timeout_s)
        try:
            sock, _ = self._sock.accept()
        except TimeoutError:
            return None
        sock.settimeout(None)
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
        except Exception:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        self._sock.close()


def connect(address: tuple[str, int], authkey: bytes) -> Connection:
    return Client(address, family="AF_INET", authkey=authkey)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for torch.distributed's TCP store on rank 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

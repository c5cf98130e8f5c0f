"""Private, authenticated sockets between the front end and its engine cores (ZeroMQ CURVE).

The front end binds the core's sockets (ipc:// in a 0700 folder, or tcp:// on the node's
address for Ray replicas) and the cores connect. Before this, any process that could reach a
socket could connect: a PULL peer on the input socket gets its share of the round-robin, i.e.
other users' prompts; a PUSH peer on the output socket can send frames the front end decodes.
Now every bound socket is a CURVE server with a key pair made for this launch, and a ZAP
handler (pyzmq's `ThreadAuthenticator`) admits only the one client key made with it; the core
receives the server's public key and its client key pair with its start-up arguments (the
spawn pipe, or the Ray actor's call), never on disk or in the environment. A peer without them
fails the handshake: it never receives a message and nothing it sends is read; the refusal is
logged. Traffic is encrypted too, which matters on TCP.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)

ZAP_DOMAIN = "pagedllm-core"


@dataclass(frozen=True)
class CoreKeys:
    """What a core needs to connect: the front end's public key and its own key pair (Z85)."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes


class ChannelGuard:
    """The front end's side: one per engine core; applies CURVE to the sockets it binds and
    admits only that core's key."""

    def __init__(self, ctx: zmq.Context) -> None:
        if not zmq.has("curve"):
            raise RuntimeError("This pyzmq's libzmq has no CURVE support; the engine core's "
                               "sockets cannot be authenticated.")
        self._server_public, self._server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        self.core_keys = CoreKeys(self._server_public, client_public, client_secret)
        self.refused = 0  # handshakes refused (a peer without this launch's keys)
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: is this the core's key? (pyzmq calls it with the client's Z85 public key.)"""
        if secrets.compare_digest(key, self.core_keys.client_public):
            return True
        self.refused += 1
        logger.warning("Refused a connection to the engine core's sockets: it did not present "
                       "this server's core key (%d refused so far)", self.refused)
        return False

    def secure(self, sock: zmq.Socket) -> None:
        """Make a socket that will be bound a CURVE server behind the ZAP check."""
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.curve_secretkey = self._server_secret
        sock.curve_publickey = self._server_public
        sock.curve_server = True

    def stop(self) -> None:
        self._auth.stop()


def secure_client(sock: zmq.Socket, keys: CoreKeys) -> None:
    """The core's side: authenticate a socket before it connects."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret

"""Authenticated, encrypted TCP sockets between the frontend and remote engine cores.

Local engines talk over IPC files in an owner-only directory. Replicas on other nodes
(data parallelism on Ray) must use TCP; there the frontend's sockets are ZeroMQ CURVE
servers: traffic is encrypted, and a ZAP handler admits only the client key the
frontend generated for each replica. The replica receives its keys through Ray's own
channel (the actor call that starts it), never over the sockets. Anyone else who can
reach the port gets nothing through: no request is read from an unauthenticated peer.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.auth.base import Authenticator
from zmq.auth.thread import ThreadAuthenticator


@dataclass(frozen=True)
class CurveKeys:
    """One replica's keys: the frontend's (server) pair and the replica's (client) pair,
    z85-encoded as ZeroMQ takes them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def new(cls) -> CurveKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def for_client(self) -> dict[str, bytes]:
        """What the replica needs (the server's secret stays with the frontend)."""
        return {
            "server_public": self.server_public,
            "client_public": self.client_public,
            "client_secret": self.client_secret,
        }


def secure_server(socket: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make ``socket`` (before it binds) a CURVE server holding ``keys``' server pair."""
    socket.curve_secretkey = keys.server_secret
    socket.curve_publickey = keys.server_public
    socket.curve_server = True


def secure_client(socket: zmq.Socket[bytes], client_keys: dict[str, bytes] | None) -> None:
    """Make ``socket`` (before it connects) a CURVE client with the replica's keys; a
    no-op without keys (an IPC socket)."""
    if not client_keys:
        return
    socket.curve_serverkey = client_keys["server_public"]
    socket.curve_publickey = client_keys["client_public"]
    socket.curve_secretkey = client_keys["client_secret"]


class ClientKeyAuthenticator:
    """The ZAP handler of one ZeroMQ context: admits CURVE clients whose public key was
    registered (one per replica), refuses every other peer. The refusals on the sockets
    it :meth:`watch` es are counted and logged (:mod:`.refused_peers`)."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        from enginecore.engine.refused_peers import RefusedPeers

        self._allowed: set[bytes] = set()
        self._lock = threading.Lock()
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)
        self.refused = RefusedPeers()

    def watch(self, socket: zmq.Socket[Any]) -> None:
        self.refused.watch(socket)

    def problem(self) -> str | None:
        """Why this context's sockets are not guarded as they should be (a thread that
        died), or None."""
        if not self._auth.is_alive():
            return "the data-parallel sockets' key-checking (ZAP) thread is dead"
        if not self.refused.alive():
            return "the data-parallel sockets' handshake-watching thread is dead"
        return None

    def allow(self, client_public: bytes) -> None:
        with self._lock:
            self._allowed.add(client_public)

    def callback(self, _domain: str, key: bytes) -> bool:
        """zmq.auth's credentials-provider protocol (called with the ZAP domain and the
        client's key): is this client key one of ours?"""
        with self._lock:
            return key in self._allowed

    def stop(self) -> None:
        self.refused.stop()
        if self._auth.is_alive():
            self._auth.stop()
            return
        # Its thread died: nothing reads the control pipe, where a TERMINATE would block
        # for good. Close the sockets it left instead.
        if self._auth.pipe is not None:
            self._auth.pipe.close(0)
            self._auth.pipe = None  # type: ignore[assignment]
        Authenticator.stop(self._auth)


_AUTHENTICATORS: weakref.WeakKeyDictionary[Any, ClientKeyAuthenticator] = (
    weakref.WeakKeyDictionary()
)


def authenticator_for(ctx: Any) -> ClientKeyAuthenticator:
    """The context's authenticator, started on first use (one ZAP handler per context)."""
    auth = _AUTHENTICATORS.get(ctx)
    if auth is None:
        auth = _AUTHENTICATORS[ctx] = ClientKeyAuthenticator(ctx)
    return auth


def authenticator_problem(ctx: Any) -> str | None:
    """What is wrong with the context's authenticator, if it has one (see
    :meth:`ClientKeyAuthenticator.problem`)."""
    auth = _AUTHENTICATORS.get(ctx)
    return None if auth is None else auth.problem()


def stop_authenticator(ctx: Any) -> None:
    """Stop the context's authenticator, if it has one (before the context terminates)."""
    auth = _AUTHENTICATORS.pop(ctx, None)
    if auth is not None:
        auth.stop()


def keys_from_secret(secret: str, purpose: str) -> CurveKeys:
    """A server and a client key pair derived from a secret both ends were configured
    with (two instances on different hosts, as in disaggregated prefill): whoever holds
    the secret derives the same keys, nobody else can."""
    import hashlib

    from zmq.utils import z85

    def pair(role: str) -> tuple[bytes, bytes]:
        seed = hashlib.sha256(f"enginecore\0{purpose}\0{role}\0{secret}".encode()).digest()
        secret_key = z85.encode(seed)
        return zmq.curve_public(secret_key), secret_key

    server_public, server_secret = pair("server")
    client_public, client_secret = pair("client")
    return CurveKeys(server_public, server_secret, client_public, client_secret)

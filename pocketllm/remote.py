"""The TCP link between rank 0's scheduler and worker ranks on other hosts.

The scheduler binds one ROUTER socket on the address it is given; each remote rank
connects a DEALER. Both ends authenticate with CurveZMQ keys derived from the run's
secret (a file every host has), so a peer without the secret fails the handshake and
can inject nothing. Both ends send a heartbeat every second; a side that hears nothing
for HEARTBEAT_TIMEOUT_S treats the run as dead.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Optional

import zmq
import zmq.auth.thread

from .errors import InvalidRequestError
from .proto import codec
from .proto.messages import Ping

HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0
ZAP_DOMAIN = "pocketllm"


def read_secret(path: Optional[str]) -> bytes:
    """The run secret: the file's bytes, or POCKETLLM_RUN_SECRET. At least 16 bytes."""
    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise InvalidRequestError(f"cannot read the run secret {path!r}: {e}",
                                      "tensor_parallel_secret_file") from None
    else:
        secret = os.environ.get("POCKETLLM_RUN_SECRET", "").encode()
    if len(secret) < 16:
        raise InvalidRequestError(
            "ranks on several hosts need a shared secret of at least 16 bytes: pass "
            "--tensor-parallel-secret-file (the same file on every host) or set "
            "POCKETLLM_RUN_SECRET", "tensor_parallel_secret_file")
    return secret


def _keypair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    private = zmq.utils.z85.encode(hashlib.sha256(b"pocketllm-curve-" + role + secret).digest())
    return zmq.curve_public(private), private


def plan_endpoint(addr: str, master_port: int) -> str:
    """torch.distributed's store takes master_port; the plan link the port after it."""
    return f"tcp://{addr}:{master_port + 1}"


class RemoteRanks:
    """Scheduler side: the ranks on other hosts, reached through one authenticated ROUTER."""

    def __init__(self, ctx: zmq.Context, endpoint: str, secret: bytes, ranks: list[int]):
        self.ranks = ranks
        server_public, server_private = _keypair(secret, b"server")
        client_public, _ = _keypair(secret, b"client")
        self._auth = zmq.auth.thread.ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, _OnlyKey(client_public))
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.curve_server = True
        self.sock.curve_publickey, self.sock.curve_secretkey = server_public, server_private
        self.sock.zap_domain = ZAP_DOMAIN.encode()
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.last_heard: dict[int, float] = {}  # from a rank's first message (after loading)
        self._last_ping = 0.0

    def send_all(self, data: bytes) -> None:
        for r in self.ranks:
            self.sock.send_multipart([f"rank{r}".encode(), data])

    def recv(self) -> tuple[int, bytes]:
        ident, data = self.sock.recv_multipart()
        rank = int(ident.decode().removeprefix("rank"))
        self.last_heard[rank] = time.monotonic()
        return rank, data

    def tick(self) -> Optional[int]:
        """Send heartbeats; return a rank that has gone silent, if any."""
        now = time.monotonic()
        if now - self._last_ping >= HEARTBEAT_S:
            self._last_ping = now
            self.send_all(codec.encode(Ping()))
        return next((r for r, t in self.last_heard.items() if now - t > HEARTBEAT_TIMEOUT_S),
                    None)

    def close(self) -> None:
        self.sock.close(linger=0)
        self._auth.stop()


class _OnlyKey:
    """ZAP credentials check: admit exactly the client key derived from the run secret."""

    def __init__(self, key: bytes):
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


class SchedulerLink:
    """Worker side on a remote host: plans in, readiness out, heartbeats both ways."""

    def __init__(self, ctx: zmq.Context, endpoint: str, secret: bytes, rank: int):
        server_public, _ = _keypair(secret, b"server")
        client_public, client_private = _keypair(secret, b"client")
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.curve_serverkey = server_public
        self.sock.curve_publickey, self.sock.curve_secretkey = client_public, client_private
        self.sock.identity = f"rank{rank}".encode()
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(endpoint)
        self.last_heard = self._last_ping = time.monotonic()

    def send(self, data: bytes) -> None:
        self.sock.send(data)

    def recv(self) -> bytes:
        """The next message that is not a heartbeat; exits the process if rank 0 went silent.
        Heartbeats go out while waiting (one thread owns the socket)."""
        while True:
            now = time.monotonic()
            if now - self._last_ping >= HEARTBEAT_S:
                self._last_ping = now
                self.sock.send(_PING)
            if not self.sock.poll(int(HEARTBEAT_S * 1000)):
                if time.monotonic() - self.last_heard > HEARTBEAT_TIMEOUT_S:
                    os._exit(1)  # rank 0's host is gone: the run is over
                continue
            data = self.sock.recv()
            self.last_heard = time.monotonic()
            if data != _PING:
                return data


_PING = codec.encode(Ping())

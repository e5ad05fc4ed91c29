"""Connection hygiene: no client may hold the server's sockets or file descriptors.

- **Idle / keep-alive**: a connection that sends nothing is closed ``keepalive_timeout``
  seconds after it opened (here: aiohttp releases before aio-libs/aiohttp#13681 never close
  one that has sent no request), and one that sends no new request head, that long after
  its previous response (aiohttp's keep-alive).
- **Request head**: once the first byte of a head arrives, the whole head must follow
  within ``header_timeout`` seconds (a slowloris sending a byte a second is closed).
- **Body**: a request's whole body must arrive within ``body_timeout`` seconds (408).
- **Count**: at most ``max_connections`` are open at once, below the process's file
  descriptor limit (raised to its hard limit at start) by FD_MARGIN; one past the cap
  gets a 503 and is closed at once, so the server keeps serving the rest.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Optional

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from . import responses as R

log = logging.getLogger("pocketllm.server")

FD_MARGIN = 256  # descriptors kept for the engine's own sockets, pipes and files
REFUSE_LINGER_S = 1.0  # a refused connection may read its 503 before we close it
MAX_LINGERING = 64  # refused connections allowed to linger at once; more are reset


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise the file descriptor limit from %d: %s", soft, e)
    return soft


def connection_cap(requested: Optional[int], fd_limit: int) -> int:
    """The connection cap: what was asked for, never above the fd limit less FD_MARGIN."""
    room = max(1, fd_limit - FD_MARGIN)
    if requested is None:
        return room
    if requested > room:
        log.warning("--max-connections %d is above what the file descriptor limit (%d) allows; "
                    "using %d", requested, fd_limit, room)
        return room
    return requested


def _refusal() -> bytes:
    body = json.dumps(R.error_body(
        "too many open connections to this server; retry shortly", "service_unavailable",
        code="too_many_connections")).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class ConnectionGuard:
    """Counts the open connections and enforces the cap and the head and body timeouts."""

    def __init__(self, max_connections: int, header_timeout: float, body_timeout: float,
                 idle_timeout: float):
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.open: dict[object, _Conn] = {}  # aiohttp's handler -> our wrapper
        self.lingering = 0
        self.refused = 0  # connections turned away at the cap, since start
        self.timed_out = 0  # heads or bodies that took too long, since start
        self._refusal = _refusal()

    def factory(self, make_handler):
        """A protocol factory for ``loop.create_server`` around aiohttp's ``runner.server``."""
        return lambda: _Conn(self, make_handler)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        conn = self.open.get(request.protocol)
        if conn is not None:
            conn.request_started()
        try:
            if request.body_exists:  # read it here, bounded; the handler's read() reuses it
                try:
                    await asyncio.wait_for(request.read(), self.body_timeout)
                except (HttpProcessingError, web.RequestPayloadError):
                    pass  # unreadable (bad gzip, bad chunks): the handler's read says so, a 400
                except asyncio.TimeoutError:
                    self.timed_out += 1
                    resp = R.error_response(
                        408, f"the request body did not arrive within {self.body_timeout:g} s",
                        code="body_timeout")
                    resp.force_close()
                    return resp
            return await handler(request)
        finally:
            if conn is not None:
                conn.request_done()


class _Conn(asyncio.Protocol):
    """Stands between the transport and aiohttp's RequestHandler: admits or refuses the
    connection, and times the request head."""

    def __init__(self, guard: ConnectionGuard, make_handler):
        self.guard = guard
        self.make_handler = make_handler
        self.inner = None
        self.transport: Optional[asyncio.Transport] = None
        self.busy = False  # a request is being handled
        self.head_timer: Optional[asyncio.TimerHandle] = None
        self.idle_timer: Optional[asyncio.TimerHandle] = None  # until the first byte
        self.linger_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        g = self.guard
        if len(g.open) >= g.max_connections:
            g.refused += 1
            transport.write(g._refusal)
            if g.lingering >= MAX_LINGERING:
                transport.abort()
                return
            # Half-close after the 503 and keep reading a moment, so the client can read it
            # (closing with its request unread would reset the connection).
            g.lingering += 1
            if transport.can_write_eof():
                transport.write_eof()
            self.linger_timer = asyncio.get_running_loop().call_later(
                REFUSE_LINGER_S, transport.close)
            return
        self.inner = self.make_handler()
        g.open[self.inner] = self
        self.inner.connection_made(transport)
        self.idle_timer = asyncio.get_running_loop().call_later(g.idle_timeout, self._idle)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return  # refused: discard
        self._cancel_idle_timer()
        if not self.busy and self.head_timer is None and data:
            self.head_timer = asyncio.get_running_loop().call_later(
                self.guard.header_timeout, self._head_too_slow)
        self.inner.data_received(data)

    def eof_received(self):
        if self.inner is None:
            return None  # refused: let the transport close
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        self._cancel_idle_timer()
        if self.linger_timer is not None:
            self.linger_timer.cancel()
            self.guard.lingering -= 1
            self.linger_timer = None
        if self.inner is not None:
            self.guard.open.pop(self.inner, None)
            self.inner.connection_lost(exc)

    def request_started(self) -> None:
        self.busy = True
        self._cancel_head_timer()

    def request_done(self) -> None:
        self.busy = False

    def _cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _cancel_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def _idle(self) -> None:
        self.idle_timer = None
        if self.inner is not None:
            self.inner.force_close()

    def _head_too_slow(self) -> None:
        self.head_timer = None
        if not self.busy and self.inner is not None:
            self.guard.timed_out += 1
            self.inner.force_close()


class GuardedTCPSite(web.TCPSite):
    """aiohttp's TCPSite, with every connection passing through a ConnectionGuard."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, guard: ConnectionGuard,
                 backlog: int = 1024):
        super().__init__(runner, host, port, backlog=backlog)
        self.guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.guard.factory(self._runner.server), self._host, self._port,
            backlog=self._backlog, reuse_address=self._reuse_address)

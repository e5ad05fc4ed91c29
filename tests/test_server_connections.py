"""Connection hygiene: idle and slowloris connections are closed on time and cannot starve
the server; the connection cap sits under the (raised) file-descriptor limit."""

from __future__ import annotations

import resource
import select
import socket
import time

import httpx
import pytest

from pocketllm.server.connections import (FD_MARGIN, ConnectionGuard, GuardedTCPSite,
                                          connection_cap)
from server_process import ServerProcess

KEEPALIVE_S, HEADER_S, BODY_S = 12.0, 2.0, 2.0
IDLE, SLOW = 1000, 20


@pytest.fixture(scope="module")
def server(tiny_llama):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * (IDLE + SLOW):
        pytest.skip(f"the hard file-descriptor limit ({hard}) is too low for this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process holds them all
    srv = ServerProcess("--model", tiny_llama, "--keepalive-timeout", str(KEEPALIVE_S),
                        "--header-timeout", str(HEADER_S), "--body-timeout", str(BODY_S))
    yield srv
    assert srv.stop() == 0
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def closed_count(socks: list[socket.socket]) -> int:
    """How many the server has closed (readable at EOF; nothing else is ever sent)."""
    poller = select.poll()
    for s in socks:
        poller.register(s, select.POLLIN)
    return len(poller.poll(0))


def completion_seconds(srv: ServerProcess) -> float:
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/v1/completions", timeout=60,
                   json={"prompt": "hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def test_idle_and_slowloris_connections_do_not_starve_the_server(server):
    completion_seconds(server)
    baseline = min(completion_seconds(server) for _ in range(3))
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(IDLE)]
    slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(SLOW)]
    t_slow = time.monotonic()
    try:
        for s in slow:
            s.sendall(b"P")
        # held: a new client is served about as fast as before
        held = completion_seconds(server)
        assert held < max(2.0, 10 * baseline), (held, baseline)
        slow_closed_at = None
        while time.monotonic() - t_slow < KEEPALIVE_S - 3:
            for s in slow:  # a byte of a request head every second
                try:
                    s.send(b"O")
                except OSError:
                    pass
            if slow_closed_at is None and closed_count(slow) == SLOW:
                slow_closed_at = time.monotonic() - t_slow
            time.sleep(1.0)
        # the header timeout closed the slow heads, but no idle connection before its time
        assert slow_closed_at is not None and HEADER_S - 0.5 < slow_closed_at < HEADER_S + 4
        assert closed_count(idle) == 0
        deadline = time.monotonic() + KEEPALIVE_S + 10
        while closed_count(idle) < IDLE:
            assert time.monotonic() < deadline, f"{closed_count(idle)} of {IDLE} idle closed"
            time.sleep(0.5)
        assert completion_seconds(server) < max(2.0, 10 * baseline)
    finally:
        for s in idle + slow:
            s.close()


async def test_a_connection_that_sends_nothing_is_closed_by_the_guard():
    """The guard itself closes a connection that never sends a byte (some aiohttp versions
    never do): aiohttp's keep-alive is set far beyond the test here, so only the guard acts.
    A connection that has had its answer is left to that keep-alive."""
    import asyncio

    from aiohttp import web

    async def ok(_request):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/ok", ok)
    guard = ConnectionGuard(100, header_timeout=30.0, body_timeout=30.0, idle_timeout=1.0)
    app.middlewares.append(guard.middleware)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=3600)
    await runner.setup()
    site = GuardedTCPSite(runner, "127.0.0.1", 0, guard)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]
        t0 = time.monotonic()
        silent_r, _silent_w = await asyncio.open_connection("127.0.0.1", port)
        served_r, served_w = await asyncio.open_connection("127.0.0.1", port)
        served_w.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await served_r.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(silent_r.read(), 10) == b""  # EOF: closed
        assert 0.5 < time.monotonic() - t0 < 5
        await asyncio.sleep(1.0)
        assert len(guard.open) == 1  # the served one, past the idle time, stays open
        served_w.close()
    finally:
        await runner.cleanup()


def test_slow_body_gets_408(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        s.settimeout(BODY_S + 10)
        t0 = time.monotonic()
        data = s.recv(65536)
        assert BODY_S - 0.5 < time.monotonic() - t0 < BODY_S + 8
        s.settimeout(20)  # then closed (after aiohttp's lingering read of the unsent rest)
        while part := s.recv(65536):
            data += part
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert b'"code": "body_timeout"' in body


def test_the_cap_refuses_the_excess_with_503_and_keeps_serving(tiny_llama):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard file-descriptor limit ({hard}) is too low for this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # systemd's default soft limit
    try:
        srv = ServerProcess("--model", tiny_llama, "--max-connections", "50")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    held = []
    try:
        limits = open(f"/proc/{srv.proc.pid}/limits").read()
        line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
        assert line.split()[3] == line.split()[4]  # the soft limit was raised to the hard one
        held = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(50)]
        time.sleep(0.5)
        t0 = time.monotonic()
        r = httpx.get(srv.url + "/v1/models", timeout=10)
        assert time.monotonic() - t0 < 3
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "too_many_connections"
        for s in held[:5]:
            s.close()
        time.sleep(0.5)
        assert httpx.get(srv.url + "/v1/models", timeout=10).status_code == 200
    finally:
        for s in held:
            s.close()
        assert srv.stop() == 0


def test_connection_cap_stays_under_the_fd_limit():
    assert connection_cap(None, 1024) == 1024 - FD_MARGIN
    assert connection_cap(100, 1024) == 100
    assert connection_cap(5000, 1024) == 1024 - FD_MARGIN
    assert connection_cap(None, 100) == 1

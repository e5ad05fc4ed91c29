"""`pocketllm serve`: bind HTTP at once (so /ready can say 503), load the engine, serve, stop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass, field
from typing import Optional

from aiohttp import web

from ..api.client import EngineClient
from ..config import EngineArgs
from ..errors import InvalidRequestError, PocketLLMError
from ..model_info import load_model_info
from ..protocol.limits import RequestLimits
from .admission import Admission, AdmissionLimits
from .app import ServerState, build_app
from .connections import ConnectionGuard, GuardedTCPSite, connection_cap, raise_fd_limit
from .http_errors import OpenAIAppRunner

log = logging.getLogger("pocketllm.server")

ABORT_GRACE_S = 2.0  # after the drain: how long the engine's own abort deltas may take
STRAGGLER_S = 1.0  # then: how long a handler may take to write its last chunk


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: Optional[str] = None
    api_key: Optional[str] = None
    request_timeout: Optional[float] = 600.0  # seconds per request; 0 or None: no deadline
    max_body_bytes: int = 8 << 20
    # Connection hygiene (see connections.py and docs/api.md).
    keepalive_timeout: float = 15.0  # idle, before a request head is complete
    header_timeout: float = 10.0  # from a head's first byte to its end
    body_timeout: float = 60.0  # for a request's whole body
    max_connections: Optional[int] = None  # None: the fd limit less FD_MARGIN
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)  # 429 limits

    allowed_origins: tuple[str, ...] = ()  # CORS origins ("*": any); empty: CORS off
    access_log: bool = True  # one line per request (pocketllm/server/access_log.py)

    def __post_init__(self) -> None:
        for name in ("keepalive_timeout", "header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidRequestError(f"{name} must be positive", name)
        if self.max_connections is not None and self.max_connections < 1:
            raise InvalidRequestError("max_connections must be a positive integer",
                                      "max_connections")


def default_model_name(args: EngineArgs) -> str:
    """The embedded default's name, a Hugging Face id as given (``org/name[:TAG]``), else
    the checkpoint's file or directory name."""
    from ..hub import looks_local, parse

    if args.model is None:
        return "gemma-3-270m-q4_k_m"
    ref = None if looks_local(args.model) else parse(args.model)
    return ref.name if ref is not None else os.path.basename(os.path.normpath(args.model))


def bind_failure(e: OSError) -> str:
    """Why the listening socket could not be opened, said the way a user can act on."""
    if e.errno == errno.EADDRINUSE:
        return "the port is already in use (another server?); pick another with --port"
    if e.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges); pick another with --port"
    if e.errno == errno.EADDRNOTAVAIL or isinstance(e, socket.gaierror):
        return "no such address on this machine; check --host"
    return e.strerror or str(e)


def bound_address(runner: web.AppRunner, opts: ServeOptions) -> tuple[str, int]:
    """The host and port actually bound (``--port 0`` takes a free one)."""
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            return opts.host, addr[1]
    return opts.host, opts.port


def serve(args: EngineArgs, opts: ServeOptions) -> int:
    if args.node_rank > 0:  # another host's ranks: no HTTP, no control plane
        from ..supervisor import run_worker_node

        return run_worker_node(args)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    return asyncio.run(_serve(args, opts))


class _Signals:
    """SIGINT/SIGTERM: the first one drains, the second stops at once, a third exits now."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.count = 0
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()
        self.cancel_load = threading.Event()  # read by the loading thread's supervisor
        self.client: Optional[EngineClient] = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self.count += 1
        self.stop.set()
        self.cancel_load.set()
        if self.count == 2:
            log.warning("%s again: stopping now, without waiting", sig.name)
            self.hurry.set()
            if self.client is not None:
                self.client.supervisor.hurry()
        elif self.count > 2:  # the stop itself is stuck: the stages die with us (PDEATHSIG)
            os._exit(1)

    async def sleep(self, seconds: float) -> None:
        """Sleep, waking early on a second signal."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.hurry.wait(), seconds)


async def _serve(args: EngineArgs, opts: ServeOptions) -> int:
    name = opts.served_model_name or args.served_model_name or default_model_name(args)
    state = ServerState(model_name=name, limits=RequestLimits.from_args(args),
                        api_key=opts.api_key, request_timeout=opts.request_timeout,
                        allowed_origins=tuple(opts.allowed_origins),
                        log_requests=opts.access_log,
                        admission=Admission(opts.admission))
    guard = ConnectionGuard(connection_cap(opts.max_connections, raise_fd_limit()),
                            opts.header_timeout, opts.body_timeout, opts.keepalive_timeout)
    app = build_app(state, opts.max_body_bytes)
    app.middlewares.append(guard.middleware)
    # OpenAIAppRunner: aiohttp's own parser errors answer in the OpenAI shape too. The drain
    # below waits for handlers itself; shutdown_timeout only bounds the stragglers after it.
    runner = OpenAIAppRunner(app, handler_cancellation=True, access_log=None,
                             shutdown_timeout=STRAGGLER_S,
                             keepalive_timeout=opts.keepalive_timeout)
    await runner.setup()
    try:  # bound before loading, so /ready can say 503; "listening" is logged once ready
        await GuardedTCPSite(runner, opts.host, opts.port, guard).start()
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", opts.host, opts.port, bind_failure(e))
        await runner.cleanup()
        return 1
    url = "http://%s:%d" % bound_address(runner, opts)
    log.info("loading %s (%s/ready says 503 until it is ready); at most %d connections",
             args.model or "the embedded Gemma 3 270M", url, guard.max_connections)

    loop = asyncio.get_running_loop()
    signals = _Signals(loop)
    stopper = asyncio.ensure_future(signals.stop.wait())
    # The checkpoint's metadata first, on its own (a Hugging Face id fetched): a download
    # cannot be interrupted inside its thread, and a stop during one should not wait for it.
    fetch = asyncio.ensure_future(asyncio.to_thread(load_model_info, args))
    await asyncio.wait({fetch, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if not fetch.done():
        log.info("stopped while fetching %s (a download resumes where it stopped)", args.model)
        await runner.cleanup()
        os._exit(0)  # nothing else runs yet; the fetching thread cannot be joined
    try:
        info = fetch.result()
    except PocketLLMError as e:
        await runner.cleanup()
        log.error("the engine failed to start: %s", e)
        return 1
    load = asyncio.ensure_future(asyncio.to_thread(EngineClient, args, signals.cancel_load, info))
    await asyncio.wait({load, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if not load.done():  # stopped while loading: the supervisor stops the load and reaps
        log.info("stopping before the model finished loading")
    try:
        state.client = signals.client = await load
    except PocketLLMError as e:
        await runner.cleanup()
        if signals.stop.is_set():
            return 0
        log.error("the engine failed to start: %s", e)
        return 1
    if signals.stop.is_set():
        await runner.cleanup()
        await asyncio.to_thread(state.client.close)
        return 0
    log.info("ready, listening on %s: %s on %s, loaded in %.1f s", url, state.model_name,
             state.client.capabilities.device, state.client.startup_seconds)
    exit_code = 0
    while not signals.stop.is_set():  # a dead engine takes the server down, so a supervisor restarts it
        if not state.client.supervisor.alive():
            log.error("the engine died; shutting down")
            exit_code = 1
            break
        await asyncio.wait({stopper}, timeout=0.5)
    state.draining = True  # new requests get 503, /ready says "draining"
    if exit_code == 0:
        await _drain(state, signals, args.shutdown_timeout)
    log.info("shutting down")
    await runner.cleanup()
    await asyncio.to_thread(state.client.close)
    return exit_code


async def _drain(state: ServerState, signals: _Signals, timeout: float) -> None:
    """Let in-flight requests finish for up to ``timeout`` s; then abort the rest, so each
    stream still ends with a closing chunk and [DONE] and each whole request gets an answer."""
    loop = asyncio.get_running_loop()
    if state.groups:
        log.info("draining %d in-flight request(s), up to %.0f s", len(state.groups), timeout)
    deadline = loop.time() + timeout
    while state.groups and loop.time() < deadline and not signals.hurry.is_set():
        await signals.sleep(0.05)
    if not state.groups:
        return
    log.info("ending %d request(s) still running (finish_reason \"abort\")", len(state.groups))
    for group in list(state.groups.values()):  # the engine's abort deltas carry the usage
        group.end_for_shutdown(now=signals.hurry.is_set())
    deadline = loop.time() + ABORT_GRACE_S
    while state.groups and loop.time() < deadline and not signals.hurry.is_set():
        await signals.sleep(0.05)
    for group in list(state.groups.values()):  # the engine did not answer: end them here
        group.end_for_shutdown(now=True)
    deadline = loop.time() + STRAGGLER_S
    while state.groups and loop.time() < deadline:  # their last chunks go out
        await asyncio.sleep(0.02)

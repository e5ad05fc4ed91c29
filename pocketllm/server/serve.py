"""`pocketllm serve`: bind HTTP at once (so /ready can say 503), load the engine, serve, stop."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
from dataclasses import dataclass
from typing import Optional

from aiohttp import web

from ..api.client import EngineClient
from ..config import EngineArgs
from ..errors import PocketLLMError
from ..protocol.limits import RequestLimits
from .app import ServerState, build_app
from .http_errors import OpenAIAppRunner

log = logging.getLogger("pocketllm.server")


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: Optional[str] = None
    api_key: Optional[str] = None
    request_timeout: Optional[float] = None
    max_body_bytes: int = 8 << 20


def default_model_name(args: EngineArgs) -> str:
    if args.model is None:
        return "gemma-3-270m-q4_k_m"
    return os.path.basename(os.path.normpath(args.model))


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
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(_serve(args, opts))


async def _serve(args: EngineArgs, opts: ServeOptions) -> int:
    name = opts.served_model_name or args.served_model_name or default_model_name(args)
    state = ServerState(model_name=name, limits=RequestLimits.from_args(args),
                        api_key=opts.api_key, request_timeout=opts.request_timeout)
    # OpenAIAppRunner: aiohttp's own parser errors answer in the OpenAI shape too.
    runner = OpenAIAppRunner(build_app(state, opts.max_body_bytes), handler_cancellation=True,
                             access_log=None, shutdown_timeout=args.shutdown_timeout)
    await runner.setup()
    try:  # bound before loading, so /ready can say 503; "listening" is logged once ready
        await web.TCPSite(runner, opts.host, opts.port).start()
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", opts.host, opts.port, bind_failure(e))
        await runner.cleanup()
        return 1
    url = "http://%s:%d" % bound_address(runner, opts)
    log.info("loading %s (%s/ready says 503 until it is ready)",
             args.model or "the embedded Gemma 3 270M", url)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    load = asyncio.ensure_future(asyncio.to_thread(EngineClient, args))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({load, stopper}, return_when=asyncio.FIRST_COMPLETED)
    exit_code = 0
    if not load.done():  # stopped while loading: let the load finish failing or succeeding
        log.info("stopping before the model finished loading")
        try:
            (await load).close()
        except Exception:
            pass
        await runner.cleanup()
        return 0
    try:
        state.client = load.result()
    except PocketLLMError as e:
        log.error("the engine failed to start: %s", e)
        await runner.cleanup()
        return 1
    log.info("ready, listening on %s: %s on %s, loaded in %.1f s", url, state.model_name,
             state.client.capabilities.device, state.client.startup_seconds)
    while not stop.is_set():  # a dead engine takes the server down, so a supervisor restarts it
        if not state.client.supervisor.alive():
            log.error("the engine died; shutting down")
            exit_code = 1
            break
        try:
            await asyncio.wait_for(asyncio.shield(stopper), 0.5)
        except asyncio.TimeoutError:
            pass
    if exit_code == 0 and state.groups:  # drain: let in-flight requests finish
        state.draining = True
        log.info("draining %d in-flight request(s), up to %.0f s", len(state.groups),
                 args.shutdown_timeout)
        deadline = loop.time() + args.shutdown_timeout
        while state.groups and loop.time() < deadline:
            await asyncio.sleep(0.05)
    log.info("shutting down")
    await runner.cleanup()
    await asyncio.to_thread(state.client.close)
    return exit_code

"""The HTTP surface: exactly the routes the spec lists, every error in the OpenAI shape."""

from __future__ import annotations

import hmac
import logging
import math
import uuid
from dataclasses import dataclass, field
from typing import Optional

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..api.client import EngineClient
from ..errors import (InvalidRequestError, PocketLLMError, RequestIdInUseError,
                      RequestNotFoundError)
from ..proto.messages import SchedulerStats
from ..protocol import limits as L
from ..protocol.limits import DEFAULT_LIMITS, RequestLimits
from ..protocol.openai_fields import ParsedRequest, parse_chat, parse_completion
from . import responses as R
from .http_errors import expect_handler, openai_errors
from .access_log import GROUP, access_log
from .cors import cors_middleware
from .admission import Admission, client_of
from .metrics import Metrics
from .model_cards import list_models, retrieve_model
from .streaming import ChoiceGroup

log = logging.getLogger("pocketllm.server")

STATE = web.AppKey("state", object)


@dataclass
class ServerState:
    model_name: str
    api_key: Optional[str] = None
    request_timeout: Optional[float] = None
    client: Optional[EngineClient] = None  # None until the engine is ready
    draining: bool = False  # SIGTERM received: finish what runs, accept nothing new
    metrics: Optional[Metrics] = None  # None: one labelled with model_name
    # Active requests by (caller scope, request id): see _scope.
    groups: dict[tuple[str, str], ChoiceGroup] = field(default_factory=dict)
    limits: RequestLimits = DEFAULT_LIMITS  # the engine's settings; client.limits once ready
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: off
    log_requests: bool = True  # the access log's line per request

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = Metrics(self.model_name)

    def request_limits(self) -> RequestLimits:
        """With the model's bounds (vocabulary, context) once the engine is loaded."""
        return self.client.limits if self.client is not None else self.limits
    admission: Admission = field(default_factory=Admission)  # limits per server and client


def build_app(state: ServerState, max_body_bytes: int = 8 << 20) -> web.Application:
    edge = ([access_log] if state.log_requests else []) + (
        [cors_middleware(state.allowed_origins)] if state.allowed_origins else [])
    app = web.Application(client_max_size=max_body_bytes,
                          middlewares=[*edge, openai_errors, _auth])
    app[STATE] = state
    for method, path, handler in (
            # /health tells the same truth as /ready: 200 only when every process is up.
            ("GET", "/health", ready), ("GET", "/alive", alive), ("GET", "/ready", ready),
            ("GET", "/metrics", metrics), ("GET", "/v1/models", models),
            ("GET", "/v1/models/{model_id:.+}", model),
            ("POST", "/v1/chat/completions", chat_completions),
            ("POST", "/v1/completions", completions),
            ("DELETE", "/v1/requests/{request_id}", cancel_request)):
        # An Expect header is answered before any middleware runs: by expect_handler.
        app.router.add_route(method, path, handler, expect_handler=expect_handler)
    return app


# ---------------------------------------------------------------- middleware


@web.middleware
async def _auth(request: web.Request, handler):
    key = request.app[STATE].api_key
    if key and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return R.error_response(401, "missing or wrong API key: send "
                                    "'Authorization: Bearer <key>'", code="invalid_api_key")
    return await handler(request)


# ---------------------------------------------------------------- probes


async def alive(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def ready(request: web.Request) -> web.Response:
    client = request.app[STATE].client
    if client is None:
        return web.json_response({"status": "loading"}, status=503)
    if request.app[STATE].draining:
        return web.json_response({"status": "draining"}, status=503)
    if not client.supervisor.alive():
        return web.json_response({"status": "dead"}, status=503)
    hung = client.heartbeat.unresponsive()
    if hung:  # alive but stuck: requests would wait, so a load balancer should look elsewhere
        # rounded up: a stage just past the bound must not read as exactly at it
        waited = {k: math.ceil(v * 10) / 10 for k, v in hung.items()}
        waits = ", ".join(f"{name} for {s:.1f} s" for name, s in sorted(waited.items()))
        return web.json_response({
            "status": "unresponsive", "stages": waited,
            "message": f"no heartbeat answer from {waits} (bound: "
                       f"{client.args.heartbeat_timeout:g} s)"}, status=503)
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = state.client.stats if state.client is not None else SchedulerStats()
    body = state.metrics.render(stats)
    return web.Response(body=body, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


async def models(request: web.Request) -> web.Response:
    return list_models(request.app[STATE])


async def model(request: web.Request) -> web.Response:
    return retrieve_model(request.app[STATE], request.match_info["model_id"])


# ---------------------------------------------------------------- generation


# JSON, or a type that says nothing (curl -d sends form-urlencoded; some clients send none).
_JSON_TYPES = ("application/json", "application/x-www-form-urlencoded", "text/plain",
               "application/octet-stream")


async def _read_body(request: web.Request, limits: RequestLimits) -> dict:
    ctype = request.content_type  # application/octet-stream when absent
    if ctype not in _JSON_TYPES and not ctype.endswith("+json"):
        raise web.HTTPUnsupportedMediaType(text=f"the request body must be JSON (Content-Type: "
                                           f"application/json), not {ctype[:100]!r}")
    charset = request.charset
    if charset is not None and charset.lower().replace("-", "") != "utf8":
        raise web.HTTPUnsupportedMediaType(text=f"the request body must be UTF-8, not charset "
                                           f"{charset[:40]!r}")
    try:
        raw = await request.read()
    except (HttpProcessingError, web.RequestPayloadError) as e:  # bad gzip, bad chunks
        why = (getattr(e, "message", None) or str(e) or type(e).__name__).strip()
        raise InvalidRequestError(f"the request body could not be read: "
                                  f"{why.splitlines()[-1].strip()[:120]}") from None
    return L.parse_body(raw, limits)  # UTF-8, strict JSON, depth, no lone surrogates


def _scope(request: web.Request) -> str:
    """Whose request ids these are: the caller's credential (its Authorization header as
    sent). A client-chosen id is only a label within its caller's scope: another caller can
    neither cancel it nor be refused for reusing it. The engine itself runs every request
    under a server-generated id."""
    return request.headers.get("Authorization", "")


def error_answer(e: BaseException) -> web.Response:
    """The one mapping from an error to its HTTP answer (pocketllm/errors.py ERRORS)."""
    if not isinstance(e, PocketLLMError):
        log.error("request failed in the server", exc_info=e)  # a bug: keep its traceback
    status, body = R.exception_body(e)
    resp = web.json_response(body, status=status)
    retry_after = getattr(e, "retry_after", None)
    if retry_after is not None:
        resp.headers["Retry-After"] = str(max(1, round(retry_after)))
    return resp


def _request_id(request: web.Request, body: dict) -> str:
    rid = body.get("request_id", request.headers.get("X-Request-Id"))
    if rid is None:
        return uuid.uuid4().hex
    return L.check_request_id(rid)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion, "completion")


async def _generate(request: web.Request, parse, kind: str) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    try:
        limits = state.request_limits()
        body = await _read_body(request, limits)
        rid = _request_id(request, body)
        # The engine's ids are the server's own (unique, unguessable); rid labels the answer.
        parsed: ParsedRequest = parse(body, uuid.uuid4().hex, limits)
        client = state.client
        if client is None:
            return R.error_response(503, "the model is still loading; retry when /ready says 200",
                                    "service_unavailable", code="loading")
        if state.draining:
            return R.error_response(503, "the server is shutting down", "service_unavailable",
                                    code="shutting_down")
        key = (_scope(request), rid)
        if key in state.groups:
            raise RequestIdInUseError(f"request_id {rid!r} is already in use by an active "
                                      "request of yours", "request_id")
        who = client_of(request, bool(state.api_key))
        ticket = state.admission.admit(who, len(parsed.choices))
        for choice in parsed.choices:
            choice.client = who
        group = ChoiceGroup(state, client, parsed, kind, rid)
        state.groups[key] = group
        request[GROUP] = group  # the access log reads its usage and TTFT
        try:
            return await group.respond(request)
        finally:
            state.groups.pop(key, None)
            group.close()
            state.admission.release(ticket)
    except (ConnectionError, web.HTTPException):
        raise  # the client left (nobody to answer), or aiohttp's own answer (the middleware)
    except Exception as e:  # noqa: BLE001 - every failure gets its kind's status, OpenAI-shaped
        return error_answer(e)


async def cancel_request(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    rid = request.match_info["request_id"]
    group = state.groups.get((_scope(request), rid))  # only the caller's own requests
    if group is None or group.gen.finished:
        return error_answer(RequestNotFoundError(
            f"no active request {rid!r} of yours (unknown, already finished, or sent with "
            "other credentials)"))
    group.gen.cancel()  # each choice still ends with the engine's own "abort" delta
    return web.json_response({"id": rid, "object": "request.cancelled", "cancelled": True})


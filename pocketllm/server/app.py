"""The HTTP surface: exactly the routes the spec lists, every error in the OpenAI shape."""

from __future__ import annotations

import hmac
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Optional

from aiohttp import web

from ..api.client import EngineClient
from ..errors import (EngineDeadError, InvalidRequestError, PocketLLMError, PromptTooLongError,
                      UnsupportedFeatureError)
from ..proto.messages import SchedulerStats
from ..protocol.openai_fields import ParsedRequest, parse_chat, parse_completion
from . import responses as R
from .metrics import Metrics
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
    metrics: Metrics = field(default_factory=Metrics)
    groups: dict[str, ChoiceGroup] = field(default_factory=dict)  # active, by request id


def build_app(state: ServerState, max_body_bytes: int = 8 << 20) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_errors, _auth])
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/alive", alive)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_delete("/v1/requests/{request_id}", cancel_request)
    return app


# ---------------------------------------------------------------- middleware


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return R.error_response(413, f"the request body is over this server's limit of "
                                f"{request.app._client_max_size} bytes",
                                code="request_too_large")
    except web.HTTPNotFound:
        return R.error_response(404, f"no route {request.method} {request.path}: this server "
                                "serves /v1/chat/completions, /v1/completions, /v1/models, "
                                "/v1/requests/<id>, /health, /alive, /ready and /metrics",
                                code="not_found")
    except web.HTTPMethodNotAllowed:
        return R.error_response(405, f"{request.method} is not allowed on {request.path}",
                                code="method_not_allowed")


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


def _engine(request: web.Request) -> Optional[EngineClient]:
    return request.app[STATE].client


async def alive(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def ready(request: web.Request) -> web.Response:
    client = _engine(request)
    if client is None:
        return web.json_response({"status": "loading"}, status=503)
    if request.app[STATE].draining:
        return web.json_response({"status": "draining"}, status=503)
    if not client.supervisor.alive():
        return web.json_response({"status": "dead"}, status=503)
    return web.json_response({"status": "ready"})


async def health(request: web.Request) -> web.Response:
    # The same truth as /ready: 200 only when every process of the engine is up.
    return await ready(request)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = state.client.stats if state.client is not None else SchedulerStats()
    body = state.metrics.render(stats)
    return web.Response(body=body, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    client = state.client
    card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "pocketllm"}
    if client is not None:
        card["max_model_len"] = client.info.max_model_len
    return web.json_response({"object": "list", "data": [card]})


# ---------------------------------------------------------------- generation


async def _read_body(request: web.Request) -> dict:
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError("the request body is not valid UTF-8") from None
    try:
        body = json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return body


def _request_id(request: web.Request, body: dict) -> str:
    rid = body.get("request_id", request.headers.get("X-Request-Id"))
    if rid is None:
        return uuid.uuid4().hex
    if not isinstance(rid, str) or not rid or len(rid) > 200:
        raise InvalidRequestError("request_id must be a non-empty string of at most 200 "
                                  "characters", "request_id")
    return rid


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion, "completion")


async def _generate(request: web.Request, parse, kind: str) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    try:
        body = await _read_body(request)
        rid = _request_id(request, body)
        parsed: ParsedRequest = parse(body, rid)
        client = state.client
        if client is None:
            return R.error_response(503, "the model is still loading; retry when /ready says 200",
                                    "service_unavailable", code="loading")
        if state.draining:
            return R.error_response(503, "the server is shutting down", "service_unavailable",
                                    code="shutting_down")
        if rid in state.groups:
            raise InvalidRequestError(f"request_id {rid!r} is already in use", "request_id")
        group = ChoiceGroup(state, client, parsed, kind, rid)
        state.groups[rid] = group
        try:
            return await group.respond(request)
        finally:
            state.groups.pop(rid, None)
            group.close()
    except PromptTooLongError as e:
        return R.error_response(400, str(e), param=e.param, code="context_length_exceeded")
    except InvalidRequestError as e:
        return R.error_response(400, str(e), param=e.param)
    except UnsupportedFeatureError as e:
        return R.error_response(400, str(e), param=e.param, code="unsupported")
    except EngineDeadError as e:
        return R.error_response(503, str(e), "service_unavailable", code="engine_dead")
    except PocketLLMError as e:
        return R.error_response(500, str(e), "server_error")


async def cancel_request(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    rid = request.match_info["request_id"]
    group = state.groups.get(rid)
    if group is None or group.finished:
        return R.error_response(404, f"no active request {rid!r} (unknown or already finished)",
                                code="not_found")
    group.cancel()
    return web.json_response({"id": rid, "object": "request.cancelled", "cancelled": True})


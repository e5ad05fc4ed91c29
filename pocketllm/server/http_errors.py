"""Every HTTP error in the OpenAI shape, aiohttp's own included.

Three places answer errors in aiohttp. What the router and the handlers raise
(404, 405, 413, ...) passes through the `openai_errors` middleware. What the
HTTP parser refuses (a malformed request line, a header over the line limit,
too many headers, a bad chunk) never reaches the application: the connection's
RequestHandler answers it in `handle_error`, in plain text. `OpenAIAppRunner`
serves the application with a RequestHandler whose `handle_error` answers in
the OpenAI shape too (and also the last-resort 500 of an exception a handler
let escape). And an `Expect` header is answered before any middleware, by the
route's expect handler: every route gets `expect_handler` below.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from aiohttp import HttpVersion11, hdrs, web, web_protocol
from aiohttp.http_exceptions import BadHttpMessage, BadStatusLine, LineTooLong

from ..protocol.limits import MAX_HTTP_HEADERS, MAX_HTTP_LINE_BYTES
from . import responses as R

log = logging.getLogger("pocketllm.server")

_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
          405: "method_not_allowed", 408: "request_timeout", 411: "length_required",
          413: "request_too_large", 414: "uri_too_long", 415: "unsupported_media_type",
          417: "expectation_failed", 422: "unprocessable_entity", 429: "rate_limit_exceeded",
          431: "request_header_fields_too_large", 500: "internal_error",
          501: "not_implemented", 503: "service_unavailable", 504: "timeout"}


async def expect_handler(request: web.Request) -> Optional[web.Response]:
    """``Expect: 100-continue`` on HTTP/1.1 is answered as aiohttp does; any other
    expectation gets an OpenAI-shaped 417 (aiohttp's own is plain text)."""
    expect = request.headers.get(hdrs.EXPECT, "")
    if request.version != HttpVersion11:
        return None
    if expect.lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
        return None
    return error_for_status(417, f"this server meets no expectation but 100-continue, not "
                                 f"Expect: {expect[:100]!r}")


def error_for_status(status: int, message: str, code: Optional[str] = None) -> web.Response:
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    return R.error_response(status, message, type_, code=code or _CODES.get(status))


def _parser_error(status: int, exc: Optional[BaseException]) -> tuple[int, str]:
    """The status and message for what aiohttp's parser (or a handler) failed with."""
    if isinstance(exc, LineTooLong):
        return 431, (f"a request line or header line is longer than {MAX_HTTP_LINE_BYTES} bytes "
                     "(long request ids, cookies or tokens belong in the body)")
    if isinstance(exc, BadHttpMessage):
        first = (exc.message or "malformed request").split("\n")[0].rstrip(": ")[:120]
        if "Too many headers" in first:
            return 431, f"the request has more than {MAX_HTTP_HEADERS} headers"
        what = "request line" if isinstance(exc, BadStatusLine) else "request"
        return 400, f"malformed HTTP {what}: {first}"
    if status == 504:
        return 504, "the request handler timed out"
    if status >= 500:
        return status, "internal server error (the engine is unaffected; see the server log)"
    return status, "malformed HTTP request"


class OpenAIRequestHandler(web_protocol.RequestHandler):
    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: Optional[BaseException] = None,
                     message: Optional[str] = None) -> web.StreamResponse:
        if status >= 500:
            self.log_exception("Error handling request", exc_info=exc)
        else:  # a client's malformed bytes: not worth a traceback per request
            self.log_debug("refused a malformed request: %r", exc)
        if request.writer.output_size > 0:  # as aiohttp: nothing can be answered any more
            raise ConnectionError("Response is sent already, cannot send another response "
                                  "with the error message")
        status, text = _parser_error(status, exc)
        resp = error_for_status(status, text)
        resp.force_close()
        return resp


class _OpenAIServer(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return OpenAIRequestHandler(self, loop=self._loop, **self._kwargs)


class OpenAIAppRunner(web.AppRunner):
    """web.AppRunner whose connections answer parser errors in the OpenAI shape."""

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()  # starts and freezes the app, as AppRunner does
        return _OpenAIServer(base.request_handler, request_factory=base.request_factory,
                             handler_cancellation=base.handler_cancellation,
                             loop=asyncio.get_running_loop(), **base._kwargs)


@web.middleware
async def openai_errors(request: web.Request, handler):
    """aiohttp's HTTP exceptions (no route, method, body size, ...) in the OpenAI shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise  # redirects and the like are answers, not errors
        return _http_exception(request, e)


def _http_exception(request: web.Request, e: web.HTTPException) -> web.Response:
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        text = (f"the request body is over this server's limit of "
                f"{request.app._client_max_size} bytes")
    elif isinstance(e, web.HTTPNotFound):
        text = (f"no route {request.method} {request.path[:200]}: this server serves "
                "/v1/chat/completions, /v1/completions, /v1/models, /v1/requests/<id>, "
                "/health, /alive, /ready and /metrics")
    elif isinstance(e, web.HTTPMethodNotAllowed):
        text = (f"{request.method} is not allowed on {request.path[:200]}; allowed: "
                f"{', '.join(sorted(e.allowed_methods))}")
    else:
        text = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
    resp = error_for_status(e.status, text)
    for name in ("Allow", "Retry-After"):
        if name in e.headers:
            resp.headers[name] = e.headers[name]
    return resp

"""CORS for browser clients (`--allowed-origins`; off by default).

An allowed origin's responses carry `Access-Control-Allow-Origin` (the origin itself, or `*`
when every origin is allowed) and expose `X-Request-Id`; its preflight `OPTIONS` is answered
204 before authentication (a browser sends no credentials on a preflight). Other origins get
no CORS headers, so the browser blocks them; their requests are served as without CORS.
"""

from __future__ import annotations

from typing import Sequence

from aiohttp import web

ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
ALLOWED_HEADERS = "Authorization, Content-Type, X-Request-Id"
MAX_AGE_S = 600  # how long a browser may cache a preflight's answer


def cors_middleware(origins: Sequence[str]):
    any_origin = "*" in origins
    allowed = frozenset(origins)

    def headers_for(origin: str) -> dict:
        h = {"Access-Control-Allow-Origin": "*" if any_origin else origin,
             "Access-Control-Expose-Headers": "X-Request-Id"}
        if not any_origin:
            h["Vary"] = "Origin"
        return h

    @web.middleware
    async def cors(request: web.Request, handler):
        origin = request.headers.get("Origin")
        if origin is None or not (any_origin or origin in allowed):
            return await handler(request)
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            asked = request.headers.get("Access-Control-Request-Headers")
            return web.Response(status=204, headers={
                **headers_for(origin), "Access-Control-Allow-Methods": ALLOWED_METHODS,
                "Access-Control-Allow-Headers": asked or ALLOWED_HEADERS,
                "Access-Control-Max-Age": str(MAX_AGE_S)})
        response = await handler(request)
        response.headers.update(headers_for(origin))
        return response

    return cors

"""One log line per HTTP request (logger `pocketllm.access`; `--no-access-log` turns it off).

    POST /v1/chat/completions 200 id=8f3c… prompt_tokens=12 completion_tokens=30
        ttft=0.081s duration=1.204s client=127.0.0.1

Generation routes add the token counts and the time to the first token (of the earliest
choice; `-` when none came). A client that hung up is logged as 499. Probes and /metrics
are logged at DEBUG, so a load balancer's polling does not drown the requests.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

log = logging.getLogger("pocketllm.access")

# The request key under which a generation route leaves its ChoiceGroup: a typed key where
# aiohttp has them (it warns, NotAppKeyWarning, on a plain string there).
GROUP = (web.RequestKey("pocketllm.group", object) if hasattr(web, "RequestKey")
         else "pocketllm.group")
QUIET_PATHS = ("/health", "/alive", "/ready", "/metrics")


@web.middleware
async def access_log(request: web.Request, handler):
    start = time.monotonic()
    status, response = 500, None
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client hung up (nginx's code for it)
        raise
    finally:
        _log(request, response, status, start)


def _log(request: web.Request, response, status: int, start: float) -> None:
    level = logging.DEBUG if request.path in QUIET_PATHS else logging.INFO
    if not log.isEnabledFor(level):
        return
    duration = time.monotonic() - start
    rid = (response.headers.get("X-Request-Id") if response is not None else None) or \
        request.headers.get("X-Request-Id", "-")
    group = request.get(GROUP)
    fields = []
    if group is not None:
        usage = group.usage()
        firsts = [c.timer.first for c in group.choices if c.timer.first is not None]
        ttft = f"{min(firsts) - group.choices[0].timer.start:.3f}s" if firsts else "-"
        rid = group.rid
        fields += [f"prompt_tokens={usage['prompt_tokens']}",
                   f"completion_tokens={usage['completion_tokens']}", f"ttft={ttft}"]
    fields = [f"id={rid}", *fields, f"duration={duration:.3f}s",
              f"client={request.remote or '-'}"]
    log.log(level, "%s %s %d %s", request.method, request.path, status, " ".join(fields))

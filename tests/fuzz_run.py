"""One fuzz example against the live server: send it beside the canary, and list what broke.

Shared by tests/test_fuzz_server.py (fails on the first problem) and
tests/fuzz_survey.py (collects every failure class without stopping).
"""

from __future__ import annotations

from typing import Optional

from fuzz_checks import Answer, LiveServer, answer_problem, beside, canary, send_json, send_raw
from fuzz_strategies import encode, expand

BOUNDED_TOKENS = 16  # a body asking for at most this many tokens per choice must be answered
GIVE_UP_S = 15.0  # a longer generation is read this long, then the client hangs up


# Distinct types, so hypothesis reports each kind of failure as its own bug.
class FuzzFailure(AssertionError):
    pass


class ServerError(FuzzFailure):
    """A 5xx answer."""


class NotOpenAIShaped(FuzzFailure):
    """A non-2xx answer whose body is not {"error": {"message", "type", "param", "code"}}."""


class MalformedAnswer(FuzzFailure):
    """A 2xx answer that is not a well-formed completion or SSE stream."""


class NoAnswer(FuzzFailure):
    """The connection closed, or a cheap request timed out."""


class EngineNotReady(FuzzFailure):
    """/ready is not 200 after the example (the engine died or hangs)."""


class IdLeaked(FuzzFailure):
    """After the example ended, its request id was still "in use"."""


class CanaryChanged(FuzzFailure):
    """The well-formed request sent beside the example did not get its reference answer."""


def _int(v) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def expected_choices(kind: str, body: dict) -> Optional[int]:
    n = _int(body.get("n", 1))
    if kind == "chat" or n is None:
        return n
    prompt = body.get("prompt")
    count = len(prompt) if isinstance(prompt, list) and prompt and all(
        isinstance(p, (str, list)) for p in prompt) else 1
    return n * count


def is_bounded(kind: str, body: dict) -> bool:
    """Whether serving body is cheap, so that a timeout is the server's fault."""
    if kind == "chat":
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        mt = body.get("max_tokens", 16)
    mt = _int(mt)
    choices = max(_int(body.get("best_of", 1)) or 1, expected_choices(kind, body) or 1)
    return mt is not None and 1 <= mt <= BOUNDED_TOKENS and choices <= 8


def classify(ans: Answer, problem: Optional[str]) -> Optional[type]:
    if problem is None:
        return None
    if ans.status >= 500:
        return ServerError
    if ans.status == 0:
        return NoAnswer
    if not 200 <= ans.status < 300:
        return NotOpenAIShaped
    return MalformedAnswer


def run_body(live: LiveServer, kind: str, spec: dict, headers: dict) -> list[tuple[type, str]]:
    """Send one generated body (with headers) beside the canary; the problems found."""
    live.last = f"{kind} {repr(spec)[:300]} headers {repr(headers)[:200]}"
    body = expand(spec)
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    bounded = is_bounded(kind, body)
    payload = encode(spec).encode("utf-8", "surrogatepass")
    join = beside(send_json, live.url, path, payload, headers, 120.0 if bounded else GIVE_UP_S,
                  None if bounded else GIVE_UP_S)
    stream = body.get("stream") is True
    answers: list[Answer] = []

    def check(ans: Answer) -> Optional[str]:
        answers.append(ans)
        return answer_problem(kind, ans, stream, expected_choices(kind, body),
                              given_up_ok=not bounded)

    problems = _finish(live, join, check)
    rid = body.get("request_id", headers.get("X-Request-Id"))
    if (isinstance(rid, str) and 0 < len(rid) <= 200 and answers
            and answers[0].note != "client gave up"):
        leak = _id_still_in_use(live, rid)
        if leak is not None:
            problems.append((IdLeaked, leak))
    return problems


def _id_still_in_use(live: LiveServer, rid: str) -> Optional[str]:
    """No failure path may leave a request id registered: reuse it in a tiny request."""
    import json

    again = send_json(live.url, "/v1/completions", json.dumps(
        {"prompt": "Hi", "max_tokens": 1, "request_id": rid}).encode(), {}, 120.0, None)
    if again.status == 400 and b"already in use" in again.body:
        return f"request_id {rid[:60]!r} is still in use after its request ended"
    return None


def run_raw(live: LiveServer, data: bytes) -> list[tuple[type, str]]:
    live.last = f"raw {data[:300]!r}"
    join = beside(send_raw, live.port, data, 30.0)
    return _finish(live, join, lambda ans: answer_problem("raw", ans, False, None, False)
                   if not 200 <= ans.status < 300 else None)


def _finish(live: LiveServer, join, check) -> list[tuple[type, str]]:
    got = canary(live.url) if live.use_canary else live.reference
    ans: Answer = join()
    problems = []
    problem = check(ans)
    if problem is not None:
        problems.append((classify(ans, problem), f"{problem}; answer: {ans.show()}"))
    not_ready = live.ready()
    live.blamed = not_ready is not None
    if not_ready is not None:
        problems.append((EngineNotReady, not_ready))
    if got != live.reference:
        problems.append((CanaryChanged, f"canary got {got[:300]}, reference {live.reference}"))
    return problems

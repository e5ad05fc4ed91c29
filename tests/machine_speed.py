"""How fast a running server decodes, measured now: timing tests size their work and bounds
from it, so a loaded machine checks the same thing as an idle one."""

from __future__ import annotations

import time

import httpx


def _timed_completion(url: str, max_tokens: int) -> tuple[float, int]:
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "prompt": "probe", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    return time.monotonic() - t0, r.status_code


def seconds_per_token(url: str, probe_s: float = 0.5, max_probe_tokens: int = 2048) -> float:
    """Decode seconds per token of one sequence on this server, at the fastest it ran.

    A one-token request's time (HTTP, prefill) is subtracted, so this is the decode step
    alone. Probes double from 8 tokens until one takes ``probe_s``, so none runs long on a
    loaded machine (nor into a --request-timeout of four times ``probe_s``). The longest probe
    runs twice and the faster run counts: callers use this as the machine at its quickest,
    which makes their premises ("this would take N deadlines") hold on a busy machine too.
    A probe cut by the server's deadline (504) counts as having taken that long, which is
    faster than it really was."""
    _timed_completion(url, 1)  # warm
    base = min(_timed_completion(url, 1)[0] for _ in range(2))
    n = 8
    while True:
        took, status = _timed_completion(url, n)
        assert status in (200, 504), status
        if took >= probe_s or n >= max_probe_tokens or status == 504:
            break
        n *= 2
    if status == 200:
        took = min(took, _timed_completion(url, n)[0])
    decode = max(took - base, took / 4)  # a slow one-token baseline cannot make it vanish
    return decode / (n - 1)

"""Admission control at the HTTP edge: bounded work per server and per client.

A request is held from the moment it is admitted until its last byte is sent
(queued in a stage, waiting in the scheduler or running). The server holds at
most ``max_requests`` requests and ``max_choices`` choices (a request with
``n=128`` is 128 choices; completions count prompts x ``best_of``), and each
client at most ``max_client_requests`` / ``max_client_choices``. Past a limit a
new request gets a 429 with ``Retry-After``; a request that could never fit a
limit gets a 400. The scheduler orders the admitted choices fairly across
clients (the ``client`` tag this module gives each request), so one client that
fills its share cannot delay another's request behind its own queue.

A client is the peer's address, together with the API key it presented when
the server checks keys: one key shared by many hosts still separates them, and
keys of different tenants on one host are separate clients. Behind a reverse
proxy every request comes from the proxy's address, so the proxy is one client.

The offline ``LLM`` / ``AsyncLLM`` do not rate-limit: their caller owns the
process and its queue.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

from aiohttp import web

from ..errors import InvalidRequestError, RateLimitedError


@dataclass
class AdmissionLimits:
    """The documented defaults (docs/api.md "Admission"); 0 turns a limit off."""

    max_requests: int = 256
    max_choices: int = 1024
    max_client_requests: int = 64
    max_client_choices: int = 256
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_choices", "max_client_requests",
                     "max_client_choices", "retry_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequestError(f"{name} must be a non-negative integer", name)


class RateLimited(RateLimitedError):
    """Refused for now: the error table answers a 429 with Retry-After. ``code`` says which
    limit ("server_busy" or "client_busy"; the message says it too)."""

    def __init__(self, message: str, code: str, retry_after_s: int):
        super().__init__(message, retry_after=retry_after_s)
        self.code = code
        self.retry_after_s = retry_after_s


@dataclass
class Ticket:
    client: str
    choices: int
    released: bool = False


class Admission:
    """Counts what the server and each client hold; one instance per server (event loop
    thread only, so no lock)."""

    def __init__(self, limits: Optional[AdmissionLimits] = None):
        self.limits = limits or AdmissionLimits()
        self.requests = 0
        self.choices = 0
        self.by_client: dict[str, list[int]] = {}  # client -> [requests, choices]

    def admit(self, client: str, choices: int) -> Ticket:
        """Hold one request of ``choices`` choices for ``client``, or raise RateLimited
        (or InvalidRequestError when the request alone is over a limit)."""
        lim = self.limits
        for limit, what in ((lim.max_choices, "this server"), (lim.max_client_choices,
                                                                "one client")):
            if limit and choices > limit:
                raise InvalidRequestError(
                    f"this request has {choices} choices (n x prompts x best_of), and "
                    f"{what} may hold at most {limit} at once; send fewer", "n")
        held = self.by_client.get(client, (0, 0))
        if lim.max_requests and self.requests + 1 > lim.max_requests or (
                lim.max_choices and self.choices + choices > lim.max_choices):
            raise RateLimited(
                f"the server is at its limit of {lim.max_requests} requests / "
                f"{lim.max_choices} choices in progress; retry after {lim.retry_after_s} s",
                "server_busy", lim.retry_after_s)
        if lim.max_client_requests and held[0] + 1 > lim.max_client_requests or (
                lim.max_client_choices and held[1] + choices > lim.max_client_choices):
            raise RateLimited(
                f"this client already has {held[0]} requests / {held[1]} choices in progress "
                f"(at most {lim.max_client_requests} / {lim.max_client_choices}); retry after "
                f"{lim.retry_after_s} s, or wait for your requests to finish",
                "client_busy", lim.retry_after_s)
        counts = self.by_client.setdefault(client, [0, 0])
        counts[0] += 1
        counts[1] += choices
        self.requests += 1
        self.choices += choices
        return Ticket(client, choices)

    def release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        self.requests -= 1
        self.choices -= ticket.choices
        counts = self.by_client[ticket.client]
        counts[0] -= 1
        counts[1] -= ticket.choices
        if counts[0] == 0:
            del self.by_client[ticket.client]


def client_of(request: web.Request, checks_keys: bool) -> str:
    """The client a request counts against: its peer address, plus the key it presented
    when the server checks keys. A short hash, so no key travels to the stages."""
    peer = request.remote or "unknown"
    key = request.headers.get("Authorization", "") if checks_keys else ""
    return hashlib.sha256(f"{peer}\0{key}".encode()).hexdigest()[:16]

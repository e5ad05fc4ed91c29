"""What every drafter shares: how many drafts a request proposes, adapted per request.

A drafter (``ngram.py``, ``replay.py``) says which tokens may follow a request's verified
ones; this base decides how many it may propose: ``k`` times the request's recent
acceptance (an exponential average of accepted / drafted), at least one. A step that
accepts none of a request's drafts pauses its drafting (``COOLDOWN`` steps, doubled each
time it fails again, back to ``COOLDOWN`` once a draft is accepted), and the step after
the pause probes with one draft, the length growing back with each accepted step (1, 2,
3, 4 for k = 4). A verification step costs more than a decode step (on a GPU 1.5 to 2.5
of them for k = 4, docs/speculative.md), and a worker's drafter pays for every draft it
proposes (an MTP layer's LM head), so a request whose drafts keep failing probes about
log2 of its steps times, each with the cheapest verification there is, not every step
at full length.

A new request starts where the drafter's recent acceptance over all requests is (an
exponential average of every verified step's accepted / drafted): while drafts keep
failing for everyone, a new request starts paused, then probes with one draft, instead
of proposing ``k`` at first (a worker's drafter is asked twice before the first
verification's result) only to fail like the others. Its pause is the one the latest
failed verification set (at most ``MAX_START_PAUSE`` steps), so a drafter useless to
every request keeps probing rarely across requests, not from ``COOLDOWN`` again in each;
a request whose drafts would be accepted loses at most that many steps of drafting.
"""

from __future__ import annotations

from typing import Optional

EMA = 0.5  # weight of the newest step in the acceptance average
SHARED_EMA = 0.25  # ... in the drafter's average over all requests
COOLDOWN = 4  # steps of the first pause
MAX_START_PAUSE = 16  # the longest pause a new request starts with


class Pace:
    """One request's acceptance average and pause."""

    def __init__(self, rate: float = 1.0, pause: int = 0) -> None:
        self.rate = rate  # acceptance average
        self.pause = pause  # steps left without drafts
        self.next_pause = max(COOLDOWN, 2 * pause)


class Drafter:
    in_worker = False  # the worker proposes the drafts (worker_drafts.py), not this process

    def __init__(self, k: int):
        self.k = k
        self._paces: dict[str, Pace] = {}
        self.recent = 1.0  # acceptance average over every request's verified steps
        self.start_pause = COOLDOWN  # a new request's, while drafts fail for everyone

    def _pace(self, request_id: str) -> Pace:
        """The request's pace; a new one's from ``recent``: paused (``start_pause``) when a
        single draft would not be proposed at that rate."""
        pace = self._paces.get(request_id)
        if pace is None:
            failing = round(self.k * self.recent) == 0
            pace = self._paces[request_id] = Pace(self.recent,
                                                  self.start_pause if failing else 0)
        return pace

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """Up to ``min(limit, k)`` drafts to follow ``tokens`` (all verified)."""
        pace = self._pace(request_id)
        self.observe(request_id, tokens)
        if pace.pause > 0:
            pace.pause -= 1
            return []
        want = min(limit, self.length(request_id))
        return self.candidates(request_id, tokens, want)[:want] if want > 0 else []

    def length(self, request_id: str) -> int:
        """How many drafts the request's next proposal carries: ``k`` times its recent
        acceptance, at least one (a worker's drafter is asked for that many, no more)."""
        return max(1, round(self.k * self._pace(request_id).rate))

    def paused(self, request_id: str) -> bool:
        """Whether the request's next step proposes nothing (its pause has steps left)."""
        return self._pace(request_id).pause > 0

    def skip(self, request_id: str) -> None:
        """A step of the paused request ran without asking (planned before the last one's
        result): one step of its pause is spent."""
        pace = self._paces.get(request_id)
        if pace is not None and pace.pause > 0:
            pace.pause -= 1

    def observe(self, request_id: str, tokens: list[int]) -> None:
        """Called with a request's verified tokens before each proposal (an index grows)."""

    def candidates(self, request_id: str, tokens: list[int], want: int) -> list[int]:
        """Up to ``want`` tokens that may follow ``tokens``."""
        raise NotImplementedError

    def verified(self, request_id: str, drafted: int, accepted: int) -> None:
        """A step verified ``drafted`` drafts of the request and accepted ``accepted``."""
        pace: Optional[Pace] = self._paces.get(request_id)
        if pace is None or drafted == 0:
            return
        self.recent = (1 - SHARED_EMA) * self.recent + SHARED_EMA * accepted / drafted
        if not accepted:
            pace.pause, pace.next_pause = pace.next_pause, 2 * pace.next_pause
            pace.rate = 1.0 / self.k  # after the pause, probe with one draft
            self.start_pause = min(pace.pause, MAX_START_PAUSE)
            return
        pace.rate = (1 - EMA) * pace.rate + EMA * accepted / drafted
        pace.next_pause = self.start_pause = COOLDOWN

    def forget(self, request_id: str) -> None:
        self._paces.pop(request_id, None)

"""N-gram drafts (prompt lookup): the tokens that followed the latest earlier occurrence of a
request's last few tokens, proposed as its next ones.

Text that copies its input (editing, summarising, quoting code) repeats long runs of the
prompt, so the tokens after a repeated n-gram are often the ones the model picks next; the
worker checks them all in one step (docs/speculative.md). No model, no torch: a dict per
request from each n-gram (``MIN_N`` to ``MAX_N`` tokens) to the position after its latest
occurrence, extended as tokens are verified, longest n-gram first.

How many to propose adapts per request: ``k`` times the request's recent acceptance (an
exponential average of accepted / drafted), at least one; a request whose drafts keep
failing proposes none for a while (``COOLDOWN`` steps, doubled each time it fails again),
so speculation costs a rejecting request little.
"""

from __future__ import annotations

from typing import Optional

MIN_N, MAX_N = 2, 4
EMA = 0.5  # weight of the newest step in the acceptance average
FAIL_RATE = 0.2  # below this average, a request pauses drafting
COOLDOWN = 4  # steps of the first pause


class _Lookup:
    """One request's n-gram index over its verified tokens."""

    def __init__(self) -> None:
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram -> position after its latest
        self.indexed = 0  # tokens[:indexed] are in the index
        self.rate = 1.0  # acceptance average
        self.pause = 0  # steps left without drafts
        self.next_pause = COOLDOWN

    def extend(self, tokens: list[int], end: int) -> None:
        """Index the n-grams ending before each position up to ``end``: the one ending at
        position i - 1 is followed by position i."""
        for i in range(max(self.indexed, 1), end):
            for n in range(MIN_N, MAX_N + 1):
                if i >= n:
                    self.follows[tuple(tokens[i - n:i])] = i
        self.indexed = max(self.indexed, end)


class NgramDrafter:
    def __init__(self, k: int):
        self.k = k
        self._lookups: dict[str, _Lookup] = {}

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """Up to ``min(limit, k)`` drafts to follow ``tokens`` (all verified)."""
        look = self._lookups.setdefault(request_id, _Lookup())
        look.extend(tokens, len(tokens))  # (the suffix itself has no follower yet)
        if look.pause > 0:
            look.pause -= 1
            return []
        want = min(limit, max(1, round(self.k * look.rate)))
        if want <= 0:
            return []
        for n in range(MAX_N, MIN_N - 1, -1):
            if len(tokens) < n:
                continue
            at = look.follows.get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at:at + want]
        return []

    def verified(self, request_id: str, drafted: int, accepted: int) -> None:
        """A step verified ``drafted`` drafts of the request and accepted ``accepted``."""
        look: Optional[_Lookup] = self._lookups.get(request_id)
        if look is None or drafted == 0:
            return
        look.rate = (1 - EMA) * look.rate + EMA * accepted / drafted
        if look.rate < FAIL_RATE:
            look.pause, look.next_pause = look.next_pause, 2 * look.next_pause
            look.rate = 1.0  # after the pause, try again at full length
        elif accepted:
            look.next_pause = COOLDOWN

    def forget(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)

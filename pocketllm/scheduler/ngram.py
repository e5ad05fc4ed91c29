"""N-gram drafts (prompt lookup): the tokens that followed the latest earlier occurrence of a
request's last few tokens, proposed as its next ones.

Text that copies its input (editing, summarising, quoting code) repeats long runs of the
prompt, so the tokens after a repeated n-gram are often the ones the model picks next; the
worker checks them all in one step (docs/speculative.md). No model, no torch: a dict per
request from each n-gram (``MIN_N`` to ``MAX_N`` tokens) to the position after its latest
occurrence, extended as tokens are verified, longest n-gram first. How many it proposes
adapts per request (``drafter.py``).
"""

from __future__ import annotations

from .drafter import Drafter

MIN_N, MAX_N = 2, 4


class _Lookup:
    """One request's n-gram index over its verified tokens."""

    def __init__(self) -> None:
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram -> position after its latest
        self.indexed = 0  # tokens[:indexed] are in the index

    def extend(self, tokens: list[int], end: int) -> None:
        """Index the n-grams ending before each position up to ``end``: the one ending at
        position i - 1 is followed by position i."""
        for i in range(max(self.indexed, 1), end):
            for n in range(MIN_N, MAX_N + 1):
                if i >= n:
                    self.follows[tuple(tokens[i - n:i])] = i
        self.indexed = max(self.indexed, end)


class NgramDrafter(Drafter):
    def __init__(self, k: int):
        super().__init__(k)
        self._lookups: dict[str, _Lookup] = {}

    def observe(self, request_id: str, tokens: list[int]) -> None:
        # (the suffix itself has no follower yet)
        self._lookups.setdefault(request_id, _Lookup()).extend(tokens, len(tokens))

    def candidates(self, request_id: str, tokens: list[int], want: int) -> list[int]:
        look = self._lookups[request_id]
        for n in range(MAX_N, MIN_N - 1, -1):
            if len(tokens) < n:
                continue
            at = look.follows.get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at:at + want]
        return []

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._lookups.pop(request_id, None)

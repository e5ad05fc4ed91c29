"""Stop strings matched on a request's output text as it streams.

The one stop matcher of the engine. Rules:

- Matching runs on the cumulative output text (never the prompt). The match that
  wins is the first one *completed* while reading left to right (smallest end);
  among matches ending at the same place, the one starting first. This makes the
  result independent of how the text was chunked: streaming one token at a time
  and receiving everything at once cut at the same place.
- The answer is cut before the match, or after it with ``include_stop_str_in_output``.
- Hold-back: after each push, the longest suffix that is a proper prefix of some
  stop string is withheld (a later token may complete the match), so it is
  bounded by the longest stop string minus one character. ``flush`` releases it
  when the request ends without a match.
- A match can never start before the withheld text (any such start would have
  been withheld), so each push only reads the new text: one Knuth-Morris-Pratt
  automaton per stop string, whose state is exactly the length of that string's
  prefix the output ends with. Memory and set-up are linear in the stop strings'
  length, and the cost per push does not grow with the answer (a stop string of
  a megabyte costs a megabyte, never its square).
- Empty strings match nothing and are ignored.
"""

from __future__ import annotations

from typing import Iterable, Optional


class _Automaton:
    """The KMP automaton of one stop string. Its failure table is built only as far as the
    output has matched the string, so a long stop string costs nothing up front."""

    def __init__(self, s: str) -> None:
        self.s = s
        self.fail: list[int] = [0]  # fail[i]: longest proper prefix of s[:i+1] that ends it
        self._k = 0  # the table's own running match length
        self.state = 0  # the length of the prefix of s the output ends with

    def _grow(self) -> None:
        s, fail, k, i = self.s, self.fail, self._k, len(self.fail)
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail.append(k)
        self._k = k

    def feed(self, text: str) -> int:
        """Advance over ``text``; returns the index in it where s completed, else -1."""
        s, fail, k, n = self.s, self.fail, self.state, len(self.s)
        for j, ch in enumerate(text):
            while k and ch != s[k]:
                k = fail[k - 1]
            if ch == s[k]:
                k += 1
                if k == n:
                    self.state = k
                    return j
                if k > len(fail):
                    self._grow()
        self.state = k
        return -1


class StopMatcher:
    def __init__(self, stop: Iterable[str], include_stop_str_in_output: bool = False) -> None:
        self.stop_strings = tuple(dict.fromkeys(s for s in stop if s))
        self._include = include_stop_str_in_output
        self._automata = [_Automaton(s) for s in self.stop_strings]
        self.held = ""
        self.matched: Optional[str] = None

    def __bool__(self) -> bool:
        return bool(self.stop_strings)

    def push(self, text: str) -> str:
        """Add new output text; return what may be released now.

        After a match (``self.matched`` set) the returned text ends at the cut and
        nothing more may be pushed.
        """
        if self.matched is not None:
            raise RuntimeError("push after a stop string matched")
        base = len(self.held)  # where ``text`` starts in held + text
        best: Optional[tuple[int, int, str]] = None  # (end, start, stop string)
        for a in self._automata:
            j = a.feed(text)
            if j >= 0:
                candidate = (base + j + 1, base + j + 1 - len(a.s), a.s)
                if best is None or candidate < best:
                    best = candidate
        buf = self.held + text
        if best is not None:
            end, start, self.matched = best
            self.held = ""
            return buf[:end] if self._include else buf[:start]
        hold = max((a.state for a in self._automata), default=0)
        self.held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """The request ended without a match: the withheld text is part of the answer."""
        held, self.held = self.held, ""
        for a in self._automata:
            a.state = 0
        return held

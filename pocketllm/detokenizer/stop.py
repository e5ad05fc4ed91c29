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
  been withheld), so each push only searches ``held + new`` text: cost per push
  does not grow with the length of the answer.
- Empty strings match nothing and are ignored.
"""

from __future__ import annotations

from typing import Iterable, Optional


class StopMatcher:
    def __init__(self, stop: Iterable[str], include_stop_str_in_output: bool = False) -> None:
        self.stop_strings = tuple(dict.fromkeys(s for s in stop if s))
        self._include = include_stop_str_in_output
        # every proper, non-empty prefix of a stop string: what a suffix must be to be held
        self._prefixes = frozenset(s[:i] for s in self.stop_strings for i in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in self.stop_strings), default=0)
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
        buf = self.held + text
        best: Optional[tuple[int, int, str]] = None  # (end, start, stop string)
        for s in self.stop_strings:
            start = buf.find(s)
            if start >= 0:
                candidate = (start + len(s), start, s)
                if best is None or candidate < best:
                    best = candidate
        if best is not None:
            end, start, self.matched = best
            self.held = ""
            return buf[:end] if self._include else buf[:start]
        hold = 0
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            if buf[-k:] in self._prefixes:
                hold = k
                break
        self.held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """The request ended without a match: the withheld text is part of the answer."""
        held, self.held = self.held, ""
        return held

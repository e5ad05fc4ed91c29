"""The waiting queue, ordered fairly across clients (the HTTP server's ``client`` tag).

Each request gets a tag one above its client's previous one, or one above the tag
of the last request admitted if that is higher (a client that was idle starts at
the front of the line, with no credit saved up). The queue stays sorted by tag,
so clients take turns one choice at a time: a client with 200 choices waiting
delays another client's new request by at most one of its own. With one client
(the offline ``LLM``, or one HTTP caller) tags rise with arrival: first come,
first served, as before. Preempted requests go back to the front (appendleft),
whatever their tag.
"""

from __future__ import annotations

from collections import deque

MAX_IDLE_CLIENTS = 1024  # remembered tags; older ones are dropped once the line passed them


class FairQueue(deque):
    def __init__(self) -> None:
        super().__init__()
        self._last_tag: dict[str, int] = {}  # client -> tag of its newest request
        self._admitted_tag = 0  # tag of the newest request admitted so far

    def add(self, req) -> None:
        """Queue a new request (it needs ``client``; gets ``fair_tag``) in its fair place."""
        tag = max(self._admitted_tag, self._last_tag.get(req.client, 0)) + 1
        self._last_tag[req.client] = tag
        req.fair_tag = tag
        i = len(self)
        for other in reversed(self):  # new tags are mostly the highest: a short walk
            if other.fair_tag <= tag:
                break
            i -= 1
        self.insert(i, req)
        if len(self._last_tag) > MAX_IDLE_CLIENTS:  # a tag the line has passed means nothing
            self._last_tag = {c: t for c, t in self._last_tag.items() if t > self._admitted_tag}

    def admitted(self, req) -> None:
        """``req`` left the queue to run: the line has reached its tag."""
        self._admitted_tag = max(self._admitted_tag, req.fair_tag)

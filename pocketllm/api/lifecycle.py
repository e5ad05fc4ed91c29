"""One caller's request from submit to its last delta: the one lifecycle that AsyncLLM, LLM
(through its event-loop thread) and the HTTP server share.

A caller's request is one or more engine requests submitted together: the prompts of one
``generate`` call, or an HTTP request's choices (n, best_of, several prompts). Their deltas
arrive on one queue and each is added to its choice's ``GenerationOutput``. They share one
deadline, a failure of any one ends them all with its typed error, and whatever ends the
caller's interest (done, timeout, cancel, a caller that left) aborts what still runs:
``async with Generation(...) as gen`` submits, and leaving it aborts the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import Optional, Sequence, Union

from ..errors import RequestFailedError
from ..outputs import GenerationOutput, Usage
from ..proto.messages import GenerateRequest, RequestOutput
from .client import EngineClient

_CUT = object()  # queued by cut(): end now, without waiting for the engine's last deltas


class Generation:
    def __init__(self, client: EngineClient, reqs: Sequence[GenerateRequest],
                 timeout: Optional[float] = None):
        """``timeout``: seconds from now for every delta to arrive; None or 0: no deadline."""
        self.client = client
        self.reqs = list(reqs)
        self.outputs = [GenerationOutput(r.request_id) for r in self.reqs]
        self._left = len(self.outputs)  # unfinished: next() tests this, not a scan a delta
        self.deadline = None if not timeout else time.monotonic() + timeout
        self.timed_out = False
        self.was_cut = False  # cut() ended it: unfinished outputs are not waited for
        self._queue: asyncio.Queue = asyncio.Queue()

    @property
    def finished(self) -> bool:
        # (exact for a caller that marked outputs itself; next() counts with _left)
        return all(o.finished for o in self.outputs)

    # ---------------------------------------------------------------- start and stop

    def submit(self) -> None:
        """Send every request; if one is refused, the ones already sent are aborted."""
        loop = asyncio.get_running_loop()

        def sink(i: int, item: Union[RequestOutput, Exception]) -> None:  # receiver thread
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(self._queue.put_nowait, (i, item))
        try:
            for i, req in enumerate(self.reqs):
                self.client.submit(req, functools.partial(sink, i))
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        """Abort every unfinished request; their final deltas still arrive here."""
        live = [o.request_id for o in self.outputs if not o.finished]
        if live:
            self.client.abort(live)

    def cut(self) -> None:
        """End ``next()`` now, whatever still runs (the caller aborts it)."""
        self._queue.put_nowait((-1, _CUT))

    async def __aenter__(self) -> "Generation":
        self.submit()
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()  # a failure, a timeout, a caller that stopped reading: stop generating

    # ---------------------------------------------------------------- deltas

    async def next(self) -> Optional[tuple[int, RequestOutput]]:
        """The next delta of any request, already accumulated; None once all finished, the
        deadline passed or cut() was called. A failed request raises its typed error."""
        while self._left:
            if self.deadline is not None and self.deadline <= time.monotonic():
                self.timed_out = True
                return None
            try:  # a queued delta needs no waiting (a busy engine queues hundreds a step)
                i, item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                timeout = None if self.deadline is None else self.deadline - time.monotonic()
                try:
                    i, item = await asyncio.wait_for(self._queue.get(), timeout)
                except asyncio.TimeoutError:
                    self.timed_out = True
                    return None
            if item is _CUT:
                self.was_cut = True
                return None
            if isinstance(item, RequestOutput) and item.finish_reason == "error":
                # (the client raises a stage's typed error first; this is one without detail)
                item = RequestFailedError(f"request {item.request_id} failed in the engine")
            out = self.outputs[i]
            if out.finished:
                continue  # nothing follows a request's last delta; never counted twice
            if isinstance(item, Exception):
                out.finish_reason = "error"
                self._left -= 1
                raise item
            out.add(item)
            self._left -= out.finished
            return i, item
        return None

    async def run(self) -> list[GenerationOutput]:
        """Submit, wait for every request to finish, and return their whole results."""
        async with self:
            while await self.next() is not None:
                pass
        return self.outputs

    def usage(self, prompt_count: int = 1) -> Usage:
        """The usage of all requests together; requests are grouped by prompt in order
        (``prompt_count`` groups of equal size) and each prompt is counted once."""
        n = len(self.outputs) // prompt_count
        total = Usage(completion_tokens=sum(o.usage.completion_tokens for o in self.outputs))
        for p in range(prompt_count):
            group = self.outputs[p * n:(p + 1) * n]
            first = next((o.usage for o in group if o.usage.prompt_tokens), None)
            if first is not None:
                total.prompt_tokens += first.prompt_tokens
                total.cached_tokens += first.cached_tokens
        return total

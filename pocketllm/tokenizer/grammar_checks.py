"""Whether a structured-output spec can become a grammar, answered off the request path.

Building an xgrammar ``Grammar`` from a JSON schema needs no vocabulary but can take
minutes for a hostile one (a schema nested 900 levels deep). The tokenizer stage
therefore never builds one on a thread that other requests wait for: the checks run
on two daemon threads of their own (xgrammar releases the GIL while it builds), each
request waits at most ``timeout_s`` for its answer and then fails with a 400, and a
build past its limit finishes in the background (it cannot be interrupted) while the
same spec sent again fails at once instead of queueing a second build. Answers are
cached by spec. The clock starts only once xgrammar is imported (its first import,
which brings torch, is the stage's own one-time cost).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional

from ..proto.messages import StructuredSpec

THREADS = 2
CACHE_SIZE = 256  # answers kept, by (kind, digest of the value): a schema may be megabytes

# A check's answer: None (it compiles) or (error kind, message), kind as RequestError's.
Answer = Optional[tuple[str, str]]


class GrammarChecks:
    def __init__(self, timeout_s: float, on_done: Optional[Callable[[], None]] = None,
                 check: Optional[Callable[[StructuredSpec], Answer]] = None):
        self.timeout_s = timeout_s
        self.on_done = on_done  # runs on a check thread when an answer is ready
        self._check = check or _check_with_xgrammar  # tests inject a stand-in
        self.ready_at: Optional[float] = time.monotonic() if check else None
        self._answers: collections.OrderedDict[tuple, Answer] = collections.OrderedDict()
        self._running: dict[tuple, Future] = {}
        self._overdue: set[tuple] = set()  # still building past some request's limit
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(THREADS):
            threading.Thread(target=self._worker, name=f"grammar-check-{i}", daemon=True).start()

    def submit(self, spec: StructuredSpec) -> Future:
        """A future of the spec's answer (already done when it is known)."""
        key = _key(spec)
        with self._lock:
            if key in self._answers:
                self._answers.move_to_end(key)
                return _done(self._answers[key])
            if key in self._overdue:
                return _done(("invalid_request", self._too_slow(spec)))
            future = self._running.get(key)
            if future is None:
                future = self._running[key] = Future()
                self._jobs.put((spec, key, future))
        return future

    def deadline(self, submitted: float) -> Optional[float]:
        """When a request that asked at ``submitted`` stops waiting (None: not yet known,
        the one-time import is still running)."""
        if self.ready_at is None:
            return None
        return max(submitted, self.ready_at) + self.timeout_s

    def expire(self, spec: StructuredSpec) -> str:
        """A request gave up on this spec: later requests for it fail at once while it builds."""
        key = _key(spec)
        with self._lock:
            if key in self._running:
                self._overdue.add(key)
        return self._too_slow(spec)

    def answer(self, spec: StructuredSpec) -> Answer:
        """Blocking form (a caller with a thread of its own): the answer within the limit."""
        future = self.submit(spec)
        while self.ready_at is None and not future.done():
            time.sleep(0.01)
        left = self.deadline(time.monotonic())
        try:
            return future.result(timeout=None if left is None else max(0.0, left - time.monotonic()))
        except TimeoutError:
            return ("invalid_request", self.expire(spec))

    def _too_slow(self, spec: StructuredSpec) -> str:
        return (f"checking the {spec.kind.replace('_', ' ')} took longer than "
                f"{self.timeout_s:g} s (structured_output_timeout_s); simplify it (less "
                "nesting, fewer alternatives, bounded repetitions) or raise the limit")

    def _worker(self) -> None:
        while True:
            spec, key, future = self._jobs.get()
            if self.ready_at is None:
                with contextlib.suppress(ImportError):
                    import xgrammar  # noqa: F401 - the one-time import is not on any clock
                self.ready_at = time.monotonic()
            try:
                result = self._check(spec)
            except Exception as e:  # noqa: BLE001 - the request's error, never the thread's end
                result = ("internal", f"checking the {spec.kind} failed: {e}")
            with self._lock:
                self._running.pop(key, None)
                self._overdue.discard(key)
                self._answers[key] = result
                while len(self._answers) > CACHE_SIZE:
                    self._answers.popitem(last=False)
            future.set_result(result)
            if self.on_done is not None:
                self.on_done()


def _key(spec: StructuredSpec) -> tuple[str, bytes]:
    return spec.kind, hashlib.sha256(spec.value.encode("utf-8", "surrogatepass")).digest()


def _done(answer: Answer) -> Future:
    future: Future = Future()
    future.set_result(answer)
    return future


def _check_with_xgrammar(spec: StructuredSpec) -> Answer:
    from ..protocol.grammar_spec import to_grammar

    try:
        to_grammar(spec)
    except ImportError as e:
        return ("unsupported", f"structured output needs the xgrammar package ({e}); pip "
                "install xgrammar, or leave response_format out")
    except ValueError as e:
        return ("invalid_request", str(e))
    return None

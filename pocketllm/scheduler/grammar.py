"""Constrained decoding (xgrammar): compiled grammars and one matcher per structured request.

The scheduler owns the grammar state: it compiles a request's ``StructuredSpec``
in a thread pool (xgrammar releases the GIL, so the engine loop keeps stepping
other requests), keeps compiled grammars in an LRU cache keyed by (kind, value),
fills one bitmask row per structured request that samples in a step, and
advances the request's matcher with every token it accepts. xgrammar (which
imports torch) is imported only when the first structured request arrives.

A spec becomes a grammar in ``protocol/grammar_spec.py`` (no vocabulary needed), which
the tokenizer stage also uses to refuse a bad schema before scheduling.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import queue
from concurrent.futures import Future
from typing import Callable, Optional

from pocketllm.proto.messages import ErrorDetail, ErrorKind, StructuredSpec
from pocketllm.protocol.grammar_spec import explain, to_grammar

CACHE_SIZE = 64  # compiled grammars kept (LRU); a compiled grammar holds per-token tables


class XGrammarCompiler:
    """Specs to xgrammar grammars over the model's vocabulary, and their matchers.

    ``load_tokenizer`` returns the checkpoint's ``tokenizers.Tokenizer`` (called once, in
    the pool); ``vocab_size`` is the width of the model's logits, which may exceed the
    tokenizer's. ``on_ready`` runs when the one-time vocabulary setup ends.
    """

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int,
                 stop_token_ids: Optional[list[int]] = None,
                 on_ready: Optional[Callable[[], None]] = None):
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids or [])
        self.on_ready = on_ready
        # When the one-time vocabulary setup finished: no request's clock runs before it.
        self.ready_at: Optional[float] = None
        self._setup_lock = threading.Lock()
        self._compiler = None

    def compile(self, spec: StructuredSpec):
        self._ensure_compiler()
        return self._compiler.compile_grammar(to_grammar(spec))

    def matcher(self, compiled, stop_ids: list[int]):
        import xgrammar as xgr

        # Once the grammar is complete only these may follow, and one of them ends the request.
        return xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids)

    def _ensure_compiler(self) -> None:
        with self._setup_lock:
            if self._compiler is not None:
                return
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            # xgrammar reads the vocabulary's encoding (byte-level or byte-fallback) from
            # the fast tokenizer's own description; GGUF vocabularies are `tokenizers` too.
            hf = PreTrainedTokenizerFast(tokenizer_object=self._load_tokenizer())
            # Stop ids are set per matcher (the request's own); these only silence a guess.
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            self.ready_at = time.monotonic()
            if self.on_ready is not None:  # the compile clocks start now: the loop must know
                self.on_ready()


class Grammars:
    """Compiles specs in a pool, caching the results; one instance per scheduler.

    ``compiler`` turns a spec into a compiled grammar (``compile``, in a pool thread) and
    one into a request's matcher (``matcher``); its ``ready_at`` says when its one-time
    setup ended (None: not yet). ``vocab_size`` is the width of the model's logits.
    ``on_done`` runs in a pool thread when a compile finishes (it wakes the scheduler loop).
    """

    def __init__(self, compiler, vocab_size: int, timeout_s: float,
                 on_done: Optional[Callable[[], None]] = None, cache_size: int = CACHE_SIZE):
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.on_done = on_done
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[tuple[str, str], Future] = collections.OrderedDict()
        self._lock = threading.Lock()  # the cache (the loop and pool threads both touch it)
        # Daemon threads, not a ThreadPoolExecutor: a compile past its time limit cannot be
        # interrupted, and exit must never wait for it.
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(min(2, os.cpu_count() or 1)):
            threading.Thread(target=self._worker, name=f"grammar-{i}", daemon=True).start()
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row

    def bitmask_rows(self, requests: list) -> tuple[dict, list]:
        """The StepPlan fields for these (request, drafts) pairs' masks: packed rows (numpy
        int32, the layout xgrammar fills; the scheduler never needs torch for it), one for
        the request's next token and one after each draft, the request id repeated for
        each; and the requests that must fail instead, each with why: its matcher raised,
        or its grammar allows no token at all here (a grammar that can match nothing: the
        request's fault)."""
        import numpy as np

        bitmask = np.zeros((sum(1 + len(d) for _, d in requests), self.words), dtype=np.int32)
        keep, ids, failures = [], [], []
        at = 0
        for req, drafts in requests:
            rows = range(at, at + 1 + len(drafts))
            at = rows.stop
            spec = req.grammar.spec
            what = spec.kind.replace("_", " ")
            try:
                req.grammar.fill_run(bitmask, rows.start, drafts)
            except Exception as e:  # noqa: BLE001 - one request's grammar, never the loop
                failures.append((req, ErrorDetail(
                    ErrorKind.internal, f"the {what} could not be applied: {explain(e)}")))
                continue
            if not all(bitmask[i].any() for i in rows):
                failures.append((req, ErrorDetail(
                    ErrorKind.invalid_request,
                    f"the {what} allows no token at this point: it can match no text "
                    "(check it for contradictory or impossible constraints)", spec.param)))
                continue
            keep.extend(rows)
            ids.extend([req.request_id] * len(rows))
        if not keep:
            return {}, failures
        return dict(structured_request_ids=ids, structured_bitmask=bitmask[keep].tobytes()), \
            failures

    def submit(self, spec: StructuredSpec) -> Future:
        """The cached or newly started compile of ``spec`` (never blocks)."""
        key = (spec.kind, spec.value)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = Future()
            self._cache[key] = future
            while len(self._cache) > self.cache_size:  # requests keep their own reference
                self._cache.popitem(last=False)
        self._jobs.put((spec, future, key))
        return future

    def _worker(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run(*job)

    def _run(self, spec: StructuredSpec, future: Future, key: tuple) -> None:
        try:
            future.set_result(self.compiler.compile(spec))
        except BaseException as e:  # noqa: BLE001 - any failure is the request's error
            future.set_exception(e)
            with self._lock:
                if self._cache.get(key) is future:  # not cached: a later request tries again
                    self._cache.pop(key, None)
        if self.on_done is not None:
            self.on_done()

    def shutdown(self) -> None:
        for _ in range(2):
            self._jobs.put(None)


class RequestGrammar:
    """The grammar state of one request: its compile, then its matcher."""

    def __init__(self, grammars: Grammars, spec: StructuredSpec, stop_ids: list[int]):
        self.grammars = grammars
        self.spec = spec
        # An id outside the vocabulary can never be sampled, so it cannot end the answer
        # either (and xgrammar refuses it): the matcher gets the ones that can.
        self.stop_ids = sorted({i for i in stop_ids if 0 <= i < grammars.vocab_size})
        self.future = grammars.submit(spec)
        self.submitted = time.monotonic()
        self.matcher = None

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def poll(self, now: float) -> Optional[str]:
        """Make the matcher once the compile is done. Returns why the request must fail
        (a bad grammar, or a compile past the time limit), else None (ready or not yet)."""
        if self.matcher is not None:
            return None
        future = self.future
        if future.done():
            error = future.exception()
            if error is not None:
                return explain(error) if isinstance(error, ValueError) else (
                    f"the {self.spec.kind.replace('_', ' ')} could not be compiled: "
                    f"{explain(error)}")
            try:
                self.matcher = self.grammars.compiler.matcher(future.result(), self.stop_ids)
            except Exception as e:  # noqa: BLE001 - this request fails, the scheduler goes on
                return (f"the {self.spec.kind.replace('_', ' ')} could not be set up for "
                        f"this request: {explain(e)}")
            return None
        left = self.deadline(now)
        if left is not None and left <= 0:
            return (f"compiling the {self.spec.kind.replace('_', ' ')} took longer than "
                    f"{self.grammars.timeout_s:g} s (structured_output_timeout_s); simplify "
                    "it (fewer alternatives, bounded repetitions) or raise the limit")
        return None

    def deadline(self, now: float) -> Optional[float]:
        """Seconds until ``poll`` may time this request out (None when its clock has not started)."""
        ready_at = self.grammars.compiler.ready_at  # its one-time setup is not counted
        if self.matcher is not None or ready_at is None:
            return None
        return max(self.submitted, ready_at) + self.grammars.timeout_s - now


    def fill_run(self, bitmask, row: int, drafts: list[int]) -> None:
        """Rows ``row`` .. ``row + len(drafts)``: the mask now, then after each draft (the
        matcher is rolled back after: the drafts are not verified yet)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        accepted = 0
        try:
            for j, token in enumerate(drafts):
                if not self.matcher.accept_token(token):
                    raise ValueError(f"draft token {token} is not allowed")
                accepted += 1
                self.matcher.fill_next_token_bitmask(bitmask, row + 1 + j)
        finally:
            if accepted:
                self.matcher.rollback(accepted)

    def allowed_prefix(self, tokens: list[int]) -> list[int]:
        """The longest start of ``tokens`` the grammar allows in turn, short of a token that
        would complete it (the request ends there: nothing after it to mask)."""
        accepted = 0
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            accepted += 1
            if self.matcher.is_terminated():
                accepted -= 1
                self.matcher.rollback(1)
                break
        if accepted:
            self.matcher.rollback(accepted)
        return tokens[:accepted]

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

"""The tokenizer stage's request loop: no request's work holds up another's.

The loop thread only receives, dispatches and sends. Rendering and tokenizing run
on a small pool of threads (tokenization releases the GIL; see stage._encode), and
a structured request then waits for its grammar check (grammar_checks.py) as an
entry in ``pending``, holding no thread, until the answer comes or its time limit
passes. Results leave in the order they are ready; nothing downstream depends on
the order of different requests.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time

import zmq

from ..proto import codec
from ..proto.messages import ErrorKind, Ping, Pong, RequestError, Shutdown, TokenizedRequest
from .stage import TokenizerStage

THREADS = 4  # rendering/tokenizing threads: a few long prompts cannot occupy them all


class TokenizerLoop:
    def __init__(self, stage: TokenizerStage, inbox: zmq.Socket, to_scheduler: zmq.Socket,
                 to_frontend: zmq.Socket):
        self.stage = stage
        self.inbox, self.to_scheduler, self.to_frontend = inbox, to_scheduler, to_frontend
        self.decoder = codec.decoder_for("tokenizer")
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: list[tuple[TokenizedRequest, object, float]] = []  # (req, future, asked)
        self.wake_r, self.wake_w = os.pipe()  # a thread's result wakes the loop
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        stage.grammar_checks.on_done = self._wake
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.poller.register(self.wake_r, zmq.POLLIN)
        for i in range(THREADS):  # daemon threads: exit never waits for a long prompt
            threading.Thread(target=self._work, name=f"tokenize-{i}", daemon=True).start()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe: the loop is awake anyway
            os.write(self.wake_w, b"\0")

    def _work(self) -> None:
        while True:
            msg = self.jobs.get()
            try:
                out = self.stage.prepare(msg)
            except Exception as e:  # noqa: BLE001 - the request fails, the thread goes on
                out = RequestError(msg.request_id, f"the tokenizer failed: {e}",
                                   kind=ErrorKind.internal)
            self.done.put(out)
            self._wake()

    def run(self) -> None:
        while True:
            events = dict(self.poller.poll(self._timeout_ms()))
            if self.inbox in events:
                while True:  # take everything queued, so the pool sees it at once
                    try:
                        raw = self.inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    msg = self.decoder.decode(raw)
                    if isinstance(msg, Shutdown):
                        return
                    if isinstance(msg, Ping):  # the frontend's heartbeat: this loop is not stuck
                        self.to_frontend.send(codec.encode(Pong("tokenizer", msg.seq)))
                        continue
                    self.jobs.put(msg)
            if self.wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
            while True:
                try:
                    out = self.done.get_nowait()
                except queue.Empty:
                    break
                self._route(out)
            self._settle_pending()

    def _timeout_ms(self):
        deadlines = [d for d in (self.stage.grammar_checks.deadline(asked)
                                 for _, _, asked in self.pending) if d is not None]
        if not deadlines:
            return 100 if self.pending else None  # (the import's end is announced too)
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    def _route(self, out) -> None:
        if isinstance(out, TokenizedRequest) and out.sampling.structured is not None:
            future = self.stage.grammar_checks.submit(out.sampling.structured)
            self.pending.append((out, future, time.monotonic()))
            return
        self._send(out)

    def _settle_pending(self) -> None:
        if not self.pending:
            return
        checks, now, still = self.stage.grammar_checks, time.monotonic(), []
        for req, future, asked in self.pending:
            spec = req.sampling.structured
            if future.done():
                answer = future.result()
                self._send(req if answer is None else RequestError(
                    req.request_id, answer[1], kind=ErrorKind(answer[0]), param=spec.param))
            elif (deadline := checks.deadline(asked)) is not None and now >= deadline:
                self._send(RequestError(req.request_id, checks.expire(spec),
                                        kind=ErrorKind.invalid_request, param=spec.param))
            else:
                still.append((req, future, asked))
        self.pending = still

    def _send(self, out) -> None:
        try:
            data = codec.encode(out)
        except Exception as e:  # noqa: BLE001 - e.g. a value that cannot travel: fail the request
            why = f"{type(e).__name__}: {e}".encode("utf-8", "replace").decode("utf-8")
            out = RequestError(out.request_id, f"the tokenized request could not be sent on "
                               f"({why})", kind=ErrorKind.invalid_request)
            data = codec.encode(out)
        sock = self.to_frontend if isinstance(out, RequestError) else self.to_scheduler
        sock.send(data)

"""Heartbeats from the frontend to every local stage, so /health sees a hung process.

A process that is alive but stuck (stopped, deadlocked, spinning in one request) passes
the supervisor's liveness check. So the frontend's receiver thread sends each stage a
numbered Ping about every second, one at a time, and the stage's main loop answers with
a Pong. A stage whose Ping has waited longer than ``EngineArgs.heartbeat_timeout`` is
unresponsive; its next answer makes it responsive again.

A worker answers between steps only. While the scheduler reports a step in flight that
is not yet much longer than steps of its size have taken lately (STEP_SLACK times the
expected length), the worker counts as busy, not hung.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import zmq

from ..proto import codec
from ..proto.messages import Ping, Pong

INTERVAL_S = 1.0
STEP_SLACK = 4.0


class Heartbeat:
    def __init__(self, ctx: zmq.Context, endpoints: dict[str, str], timeout: float):
        """``endpoints``: stage name -> the stage's inbound socket. Used from the receiver
        thread (tick, on_pong) and read from any thread (unresponsive)."""
        self.timeout = timeout
        self._socks = {}
        for name, endpoint in endpoints.items():
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._socks[name] = sock
        self._seq = 0
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[int, float]] = {}  # stage -> (seq, sent at)
        self._answered = {name: time.monotonic() for name in endpoints}
        self._step = (0.0, 0.0, 0.0)  # the scheduler's (step age, expected length, when)

    def tick(self, now: Optional[float] = None) -> None:
        """Ping each stage that has no Ping waiting and was last heard INTERVAL_S ago."""
        now = time.monotonic() if now is None else now
        for name, sock in self._socks.items():
            if name in self._waiting or now - self._answered[name] < INTERVAL_S:
                continue
            self._seq += 1
            try:
                sock.send(codec.encode(Ping(seq=self._seq)), zmq.NOBLOCK)
            except zmq.Again:  # its queue is full: it is not reading, and the Ping we wait on shows it
                continue
            with self._lock:
                self._waiting[name] = (self._seq, now)

    def on_pong(self, pong: Pong) -> None:
        now = time.monotonic()
        with self._lock:
            waiting = self._waiting.get(pong.stage)
            if waiting is not None and pong.seq >= waiting[0]:
                del self._waiting[pong.stage]
            self._answered[pong.stage] = now
            if pong.stage == "scheduler":
                self._step = (pong.step_age_s, pong.step_expected_s, now)

    def unresponsive(self) -> dict[str, float]:
        """Stage -> seconds its Ping has waited, for each stage past the bound."""
        now = time.monotonic()
        with self._lock:
            waiting = dict(self._waiting)
            age, expected, heard = self._step
        out = {}
        for name, (_seq, sent) in waiting.items():
            waited = now - sent
            if waited <= self.timeout:
                continue
            if name.startswith("worker") and age > 0:
                step_age = age + (now - heard)  # the step the scheduler last reported, now
                if step_age < STEP_SLACK * expected:
                    continue  # busy with a step that is long, but not unusually so
            out[name] = waited
        return out

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)

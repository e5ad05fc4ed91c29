"""The scheduler stage's step sequencing, apart from its sockets: plan, send, plan ahead,
receive, update.

``StepLoop.step()`` is one turn of the stage's main loop. Everything it exchanges with the
world goes through a ``StepIO`` (the stage's sockets in ``__main__.py``, a fake worker in
the tests), so the tests drive the very order the stage runs. Which steps are in flight is
the scheduler's own record (``Scheduler.oldest_plan`` / ``newest_plan``); this object keeps
only the results that arrived before ``update()`` takes them, and when each step was sent.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from typing import Optional, Protocol

from ..proto.messages import StepPlan, StepResult, TokenBatch
from .scheduler import Scheduler

STEP_RATE_HISTORY = 64  # steps whose seconds per token estimate a step's expected length


class StepIO(Protocol):
    def drain(self, block: bool) -> None:
        """Handle every waiting message (results reach ``StepLoop.receive``); when
        ``block``, wait for at least one."""

    def send_plan(self, plan: StepPlan) -> None: ...

    def emit(self, batch: TokenBatch) -> None: ...

    def report_grammar_errors(self, errors: list[tuple[str, str, str]]) -> None: ...

    def publish_stats(self, force: bool) -> None: ...


class StepLoop:
    def __init__(self, scheduler: Scheduler, io: StepIO, clock=time.monotonic):
        self.scheduler = scheduler
        self.io = io
        self.clock = clock
        self.results: dict[int, StepResult] = {}  # by step id, until update() takes them
        # Steps sent and not yet answered: (sent at, tokens); and recent seconds per token.
        self.sent: dict[int, tuple[float, int]] = {}
        self.step_rates: deque[float] = deque(maxlen=STEP_RATE_HISTORY)
        self.stalled = False  # nothing schedulable: wait for news instead of spinning
        # Per StepResult.path: steps, and their cumulative launch and device milliseconds.
        self.steps_by_path: Counter = Counter()
        self.launch_ms: Counter = Counter()
        self.device_ms: Counter = Counter()

    def step(self) -> None:
        """Plan and send when nothing is in flight or the newest plan promised a successor
        (``next_follows``); then apply the oldest step's result, unless the plan just sent
        may be followed at once. So at most two steps are in flight, and with overlap the
        worker never waits for this loop between them."""
        sched = self.scheduler
        newest = sched.newest_plan()
        promised = newest is not None and newest.next_follows
        if newest is None or promised:
            self.io.drain(block=newest is None and (self.stalled or not sched.has_unfinished()))
            plan = self._plan(promised)
            if plan is None or (plan.next_follows and sched.oldest_plan() is plan):
                return  # idle, or plan the next step now, while this one runs
        oldest = sched.oldest_plan()
        while oldest.step_id not in self.results:
            self.io.drain(block=True)
        self.io.emit(sched.update(oldest, self.results.pop(oldest.step_id)))
        self.io.publish_stats(force=not sched.has_unfinished())

    def _plan(self, promised: bool) -> Optional[StepPlan]:
        sched = self.scheduler
        plan = sched.schedule()
        if sched.structured.errors:
            errors, sched.structured.errors = sched.structured.errors, []
            self.io.report_grammar_errors(errors)
        self.io.emit(sched.take_ended())  # requests whose grammar failed this step
        if plan is None and promised:
            plan = sched.empty_plan()  # the worker waits for a next plan: send one
        self.stalled = plan is None
        if plan is None:
            self.io.publish_stats(force=True)  # idle (or stalled): gauges settle
            return None
        plan.next_follows = sched.plan_ahead_ok()
        self.sent[plan.step_id] = (self.clock(), sum(plan.num_scheduled_tokens))
        self.io.send_plan(plan)
        return plan

    def receive(self, result: StepResult) -> None:
        self.results[result.step_id] = result
        if result.path:
            self.steps_by_path[result.path] += 1
            self.launch_ms[result.path] += result.launch_ms
        self.device_ms.update(result.device_ms)  # Counter.update adds
        sent = self.sent.pop(result.step_id, None)
        if sent is not None and sent[1] > 0:
            self.step_rates.append((self.clock() - sent[0]) / sent[1])

    def oldest_unanswered(self) -> tuple[float, float]:
        """(age, expected length) in seconds of the oldest step sent and not answered; the
        expected length is what steps of its size took lately (0 when unknown)."""
        if not self.sent:
            return 0.0, 0.0
        sent, tokens = min(self.sent.values())
        expected = tokens * statistics.median(self.step_rates) if self.step_rates else 0.0
        return self.clock() - sent, expected

    def profile(self) -> dict:
        """How the steps ran, by path (the SchedulerStats fields)."""
        return {"steps_by_path": dict(self.steps_by_path),
                "step_launch_ms_by_path": dict(self.launch_ms),
                "step_device_ms_by_path": dict(self.device_ms)}

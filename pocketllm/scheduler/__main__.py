"""Scheduler process: owns the queue and the KV blocks, drives every rank step by step.

Inbound on one socket: TokenizedRequest (tokenizer), Abort (frontend), StopMatched
(detokenizer), WorkerReady and StepResult (ranks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict

import zmq

from ..process import StageContext, run_stage
from ..proto import codec, endpoints
from ..proto.messages import (Abort, ErrorKind, Ping, Pong, RequestError, SchedulerStats,
                              Shutdown, StepPlan, StepResult, StopMatched, TokenBatch,
                              TokenDelta, TokenizedRequest, WorkerReady)
from ..remote import HEARTBEAT_S, RemoteRanks, plan_endpoint, read_secret
from .grammar import Grammars, XGrammarCompiler
from .config import config_from_capabilities
from .scheduler import Scheduler
from .step_loop import StepLoop

log = logging.getLogger("pocketllm.scheduler")

EARLY_ABORT_MEMORY = 4096
STATS_INTERVAL_S = 0.1


class SchedulerLoop:
    """The stage's socket shell around ``StepLoop`` (the step order): draining the inbox,
    heartbeats, aborts that overtook their request, the grammar wake pipe, stats."""

    def __init__(self, ctx: StageContext):
        self.ctx = ctx
        self.inbox = ctx.pull(endpoints.scheduler(ctx.run_dir))
        args = ctx.args
        world, local = args.tensor_parallel_size, args.tensor_parallel_size // args.nnodes
        self.world = world
        self.ranks = [ctx.push(endpoints.worker(ctx.run_dir, r)) for r in range(local)]
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.remote: RemoteRanks | None = None
        if world > local:  # ranks on other hosts reach us over authenticated TCP
            self.remote = RemoteRanks(ctx.zmq, plan_endpoint(args.master_addr, args.master_port),
                                      read_secret(args.tensor_parallel_secret_file),
                                      list(range(local, world)))
            self.poller.register(self.remote.sock, zmq.POLLIN)
        self.ready_ranks: dict[int, WorkerReady] = {}
        self.early: list = []  # requests that arrive while ranks are still loading
        self.to_detok = ctx.push(endpoints.detokenizer(ctx.run_dir))
        self.to_frontend = ctx.push(endpoints.frontend(ctx.run_dir))
        self.decoder = codec.decoder_for("scheduler")
        self.scheduler: Scheduler | None = None
        self.steps: StepLoop | None = None
        self.stats_sent_at = 0.0
        self.stats_shape = (0, 0)
        # Aborts that overtook their request (the frontend sends them here directly).
        self.early_aborts: OrderedDict[str, None] = OrderedDict()
        # A finished grammar compile (pool thread) writes a byte here to wake a waiting loop.
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.poller.register(self.wake_r, zmq.POLLIN)

    def start(self) -> None:
        while len(self.ready_ranks) < self.world:
            self.drain(block=True)
        caps = self.ready_ranks[0].capabilities
        args = self.ctx.args

        def wake() -> None:  # from a pool thread: a compile or the vocabulary setup ended
            os.write(self.wake_w, b"\0")

        self.scheduler = Scheduler(
            config_from_capabilities(caps, args.max_num_batched_tokens, args.admission_delay,
                                     overlap_scheduling(args, caps), args.speculative_replay),
            grammars=Grammars(XGrammarCompiler(self._load_tokenizer, caps.vocab_size,
                                               list(self.ctx.info.eos_token_ids), on_ready=wake),
                              caps.vocab_size, args.structured_output_timeout_s, on_done=wake))
        self.steps = StepLoop(self.scheduler, self)
        self.ctx.ready(capabilities=caps)
        for msg in self.early:
            self.handle(msg)

    def handle(self, msg) -> None:
        sched = self.scheduler
        if isinstance(msg, Shutdown):
            raise SystemExit(0)
        if isinstance(msg, Ping):
            self.pong(msg)
            return
        if isinstance(msg, WorkerReady):
            self.ready_ranks[msg.rank] = msg
        elif sched is None:
            self.early.append(msg)
        elif isinstance(msg, TokenizedRequest):
            if self.early_aborts.pop(msg.request_id, None) is not None:
                self.emit(TokenBatch(
                    new_requests=[msg.detok],
                    deltas=[TokenDelta(msg.request_id, [], finish_reason="abort")]))
                return
            try:
                error = sched.add_request(msg)
            except Exception as e:  # noqa: BLE001 - one request's data must not end the loop
                log.exception("request %s could not be queued", msg.request_id)
                error = RequestError(msg.request_id, f"the scheduler could not queue this "
                                     f"request: {type(e).__name__}: {e}", kind=ErrorKind.internal)
            if error is not None:
                self.to_frontend.send(codec.encode(error))
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:  # it may still be in the tokenizer: remember it
                if not sched.is_active(rid):
                    self.early_aborts[rid] = None
            while len(self.early_aborts) > EARLY_ABORT_MEMORY:
                self.early_aborts.popitem(last=False)
            self.emit(sched.abort(msg.request_ids))
        elif isinstance(msg, StopMatched):
            sched.stop(msg.request_ids)
        elif isinstance(msg, StepResult):
            self.steps.receive(msg)

    def pong(self, ping: Ping) -> None:
        """Answer the frontend's heartbeat, with the oldest step in flight: the worker answers
        only between steps, so the frontend allows it as long as such a step takes lately."""
        age, expected = self.steps.oldest_unanswered() if self.steps else (0.0, 0.0)
        self.to_frontend.send(codec.encode(Pong("scheduler", ping.seq, age, expected)))

    def _load_tokenizer(self):
        from ..tokenizer.tokenizer import load_tokenizer

        return load_tokenizer(self.ctx.info).tokenizer

    def report_grammar_errors(self, errors: list[tuple[str, str, str]]) -> None:
        """Requests whose grammar failed or compiled too long: a 400 naming the problem."""
        for rid, why, param in errors:
            self.to_frontend.send(codec.encode(
                RequestError(rid, why, kind=ErrorKind.invalid_request, param=param)))

    def publish_stats(self, force: bool = False) -> None:
        """Send the gauges when the batch's shape changed, or at most every STATS_INTERVAL_S."""
        stats = self.scheduler.stats()
        shape = (stats["running"], stats["waiting"])
        now = time.monotonic()
        if not force and shape == self.stats_shape and now - self.stats_sent_at < STATS_INTERVAL_S:
            return
        self.stats_sent_at, self.stats_shape = now, shape
        self.to_frontend.send(codec.encode(SchedulerStats(**stats, **self.steps.profile())))

    def emit(self, batch: TokenBatch) -> None:
        if batch.deltas or batch.new_requests:
            self.to_detok.send(codec.encode(batch))

    def drain(self, block: bool) -> None:
        """Handle every waiting message; when ``block``, wait for at least one."""
        handled = False
        while True:
            grammar_wait = None
            if handled or not block:
                timeout = 0
            else:  # wake up for heartbeats when ranks live on other hosts
                timeout = int(HEARTBEAT_S * 1000) if self.remote else None
                # ...and when a compiling grammar's time limit passes
                sched = self.scheduler
                grammar_wait = sched.structured.wait_s(sched.clock()) if sched else None
                if grammar_wait is not None:
                    ms = int(grammar_wait * 1000) + 1
                    timeout = ms if timeout is None else min(timeout, ms)
            events = dict(self.poller.poll(timeout))
            if self.remote is not None:
                self.check_remote()
            if self.wake_r in events:  # a compile ended: let the caller schedule
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
                handled = True
            if not events:
                if handled or not block or grammar_wait is not None:
                    return
                continue
            if self.inbox in events:
                self.handle(self.decoder.decode(self.inbox.recv()))
            if self.remote is not None and self.remote.sock in events:
                msg = self.decoder.decode(self.remote.recv()[1])
                if not isinstance(msg, Ping):
                    self.handle(msg)
            handled = True

    def check_remote(self) -> None:
        silent = self.remote.tick()
        if silent is not None:  # exiting makes the supervisor reap the group and fail requests
            log.error("rank %d on another host went silent; stopping", silent)
            os._exit(1)

    def send_plan(self, plan: StepPlan) -> None:
        data = codec.encode(plan)
        for rank in self.ranks:
            rank.send(data)
        if self.remote is not None:
            self.remote.send_all(data)


def overlap_scheduling(args, caps) -> bool:
    """EngineArgs.overlap_scheduling, with None meaning: on for a single rank. (With
    tensor parallelism rank 0 broadcasts each step's tokens to the other ranks: measured
    on CPUs only so far, so it is on only when asked for.) On a CPU the worker computes a
    step as it launches it and sends its tokens at once; planning ahead still saves the
    round trip to this stage between two steps (docs/benchmarks.md: +8% decode)."""
    if args.overlap_scheduling is not None:
        return args.overlap_scheduling
    return caps.tensor_parallel_size == 1


def main(ctx: StageContext) -> None:
    loop = SchedulerLoop(ctx)
    loop.start()
    while True:
        loop.steps.step()


if __name__ == "__main__":
    run_stage("scheduler", main)

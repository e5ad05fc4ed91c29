"""Scheduler process: owns the queue and the KV blocks, drives every rank step by step.

Inbound on one socket: TokenizedRequest (tokenizer), Abort (frontend, or the
detokenizer when a stop string matched), WorkerReady and StepResult (ranks).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import zmq

from ..process import StageContext, run_stage
from ..proto import codec, endpoints
from ..proto.messages import (Abort, DetokRequest, RequestError, SchedulerStats, Shutdown,
                              StepResult, TokenBatch, TokenDelta, TokenizedRequest, WorkerReady)
from .scheduler import Scheduler, SchedulerConfig

EARLY_ABORT_MEMORY = 4096
STATS_INTERVAL_S = 0.1


class SchedulerLoop:
    def __init__(self, ctx: StageContext):
        self.ctx = ctx
        self.inbox = ctx.pull(endpoints.scheduler(ctx.run_dir))
        world = ctx.args.tensor_parallel_size
        self.ranks = [ctx.push(endpoints.worker(ctx.run_dir, r)) for r in range(world)]
        self.to_detok = ctx.push(endpoints.detokenizer(ctx.run_dir))
        self.to_frontend = ctx.push(endpoints.frontend(ctx.run_dir))
        self.decoder = codec.decoder_for("scheduler")
        self.scheduler: Scheduler | None = None
        self.pending_result: StepResult | None = None
        self.stats_sent_at = 0.0
        self.stats_shape = (0, 0)
        # Aborts that overtook their request (the frontend sends them here directly).
        self.early_aborts: OrderedDict[str, None] = OrderedDict()

    def start(self) -> None:
        ready: dict[int, WorkerReady] = {}
        early = []  # requests that arrive while ranks are still loading
        while len(ready) < len(self.ranks):
            msg = self.decoder.decode(self.inbox.recv())
            if isinstance(msg, WorkerReady):
                ready[msg.rank] = msg
            elif isinstance(msg, Shutdown):
                raise SystemExit(0)
            else:
                early.append(msg)
        caps = ready[0].capabilities
        args = self.ctx.args
        self.scheduler = Scheduler(SchedulerConfig(
            block_size=caps.block_size, num_kv_blocks=caps.num_kv_blocks,
            max_num_seqs=caps.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=caps.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
            enable_chunked_prefill=args.enable_chunked_prefill))
        self.ctx.ready(capabilities=caps)
        for msg in early:
            self.handle(msg)

    def handle(self, msg) -> None:
        sched = self.scheduler
        if isinstance(msg, TokenizedRequest):
            if self.early_aborts.pop(msg.request_id, None) is not None:
                self.emit(TokenBatch(
                    new_requests=[DetokRequest(msg.request_id, len(msg.prompt_token_ids),
                                               msg.sampling)],
                    deltas=[TokenDelta(msg.request_id, [], finish_reason="abort")]))
                return
            error = sched.add_request(msg)
            if error is not None:
                self.to_frontend.send(codec.encode(
                    RequestError(msg.request_id, error, kind="too_long", param="prompt")))
        elif isinstance(msg, Abort):
            if msg.reason == "abort":  # it may still be in the tokenizer: remember it
                for rid in msg.request_ids:
                    if not sched.is_active(rid):
                        self.early_aborts[rid] = None
                while len(self.early_aborts) > EARLY_ABORT_MEMORY:
                    self.early_aborts.popitem(last=False)
            self.emit(sched.abort(msg.request_ids, msg.reason))
        elif isinstance(msg, StepResult):
            self.pending_result = msg
        elif isinstance(msg, Shutdown):
            raise SystemExit(0)

    def publish_stats(self, force: bool = False) -> None:
        """Send the gauges when the batch's shape changed, or at most every STATS_INTERVAL_S."""
        stats = self.scheduler.stats()
        shape = (stats["running"], stats["waiting"])
        now = time.monotonic()
        if not force and shape == self.stats_shape and now - self.stats_sent_at < STATS_INTERVAL_S:
            return
        self.stats_sent_at, self.stats_shape = now, shape
        self.to_frontend.send(codec.encode(SchedulerStats(**stats)))

    def emit(self, batch: TokenBatch) -> None:
        if batch.deltas or batch.new_requests:
            self.to_detok.send(codec.encode(batch))

    def drain(self, block: bool) -> None:
        """Handle every waiting message; when ``block``, wait for at least one."""
        if block:
            self.handle(self.decoder.decode(self.inbox.recv()))
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(self.decoder.decode(data))

    def run(self) -> None:
        sched = self.scheduler
        stalled = False  # nothing schedulable: wait for news instead of spinning
        while True:
            self.drain(block=stalled or not sched.has_unfinished())
            plan = sched.schedule()
            stalled = plan is None
            if plan is None:
                self.publish_stats(force=True)  # idle (or stalled): gauges settle
                continue
            data = codec.encode(plan)
            for rank in self.ranks:
                rank.send(data)
            while self.pending_result is None or self.pending_result.step_id != plan.step_id:
                self.drain(block=True)
            result, self.pending_result = self.pending_result, None
            self.emit(sched.update(plan, result))
            self.publish_stats(force=not sched.has_unfinished())


def main(ctx: StageContext) -> None:
    loop = SchedulerLoop(ctx)
    loop.start()
    loop.run()


if __name__ == "__main__":
    run_stage("scheduler", main)

"""Continuous batching over a paged KV cache, with prefix caching and preemption.

One step: ``schedule()`` -> the workers run the ``StepPlan`` -> ``update(plan,
result)`` -> next ``schedule()``. Policy of one step, under a token budget of
``max_num_batched_tokens`` and at most ``max_num_seqs`` running requests:

1. decodes (running requests with one token left to compute), oldest first;
2. the next chunk of running requests still in prefill;
3. waiting requests, first come first served (taking turns across clients:
   fair_queue.py), while seats, budget and blocks allow (none when this step
   preempted something: memory is short).

Without chunked prefill a prompt is scheduled whole; one longer than the whole
budget is scheduled alone as the only prefill of its step (it could never fit
otherwise). Blocks are allocated for exactly the tokens computed this step.
When a running request needs a block and none is free, the newest running
request is preempted by recompute: its blocks are freed, it goes back to the
front of the waiting queue with all its tokens, and workers are told to drop
it. Workers must apply ``finished_request_ids`` before ``new_requests``.

Prefix-cache blocks are published only after the step that computed them
succeeded, so no request ever reads KV that is not there yet.

Blocks come from one pool per KV cache group the worker declared (kv_groups.py: full
attention, sliding window); a request holds one table per group, and a sliding group's
blocks that fall wholly out of its window are freed as the request advances.

A model with a recurrent state (a "state" group: Gated DeltaNet) can only resume a prompt
where a snapshot of its state was taken (kv_groups.py): with prefix caching, a step whose
chunk of a prompt passes a snapshot point (``CacheGroups.snapshots_in``) tells the worker
to snapshot the state there, mid-chunk (``StepPlan.state_snapshots``), and the snapshot is
published with the step's blocks (kv_groups.py says where, and where a later prompt
resumes).

Speculative decoding (speculation.py): a decode may bring draft tokens to its step, and
the result returns those accepted and the token after them.

With overlap (``SchedulerConfig.overlap``) the next step may be planned before
the last one's result: a request's ``num_computed_tokens`` counts the tokens of
steps in flight, each token being sampled is a ``PENDING`` placeholder until
``update()`` fills it in, and ``num_verified_tokens`` counts what results have
confirmed. Nothing is preempted while a step is in flight.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Optional

from pocketllm.proto.messages import (PENDING, CachedRequestData, ErrorDetail,
                                      ErrorKind, NewRequestData, RequestError, StepPlan,
                                      StepResult, TokenBatch, TokenDelta, TokenizedRequest,
                                      TokenLogprobs)
from pocketllm.sampling import uses_penalties

from .admission import Admission
from .block_manager import BlockManager, blocks_for
from .config import SchedulerConfig, StepDraft
from .fair_queue import FairQueue
from .kv_groups import CacheGroups
from .request import Request, RequestStatus, refusal
from .speculation import SpeculativeSteps, drafter_for
from .structured import StructuredRequests

if TYPE_CHECKING:
    from .grammar import Grammars

log = logging.getLogger("pocketllm.scheduler")


class Scheduler(Admission, SpeculativeSteps):
    def __init__(self, config: SchedulerConfig, grammars: Optional["Grammars"] = None):
        self.config = config
        self.structured = StructuredRequests(grammars)
        # Final deltas of requests that failed inside schedule() (one request's grammar): the
        # loop sends them on to the detokenizer (take_ended).
        self.ended = TokenBatch(new_requests=[], deltas=[])
        self.kv = CacheGroups(config.cache_groups, config.block_size,
                              config.enable_prefix_caching)
        self.waiting: FairQueue = FairQueue()  # a deque kept in fair order
        self.running: list[Request] = []  # admission order: the last is the newest
        self._requests: dict[str, Request] = {}  # every waiting or running request
        self._finished_ids: list[str] = []  # for the next plan's finished_request_ids
        self._next_step_id = 0
        # The one record of steps in flight: plans made and not yet updated, oldest first,
        # each with its [(request, tokens, samples)].
        self._inflight: deque[tuple[StepPlan, list[tuple[Request, int, bool]]]] = deque()
        # per step in flight: the state snapshots it writes, (group, slot, block hash)
        self._snapshots: dict[int, list[tuple[int, int, bytes]]] = {}
        # per speculative step in flight of a recurrent-state model: each request's
        # (group, slots) holding its states after each row but the last (kv_groups.py)
        self._draft_snapshots: dict[int, dict[Request, list[tuple[int, list[int]]]]] = {}
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # tokens found
        self.num_preemptions = 0
        self.num_overlapped_steps = 0
        self.drafter = drafter_for(config)
        self.spec_draft_tokens = 0  # verified drafts
        self.spec_accepted_tokens = 0
        self.clock = time.monotonic  # replaceable in tests

    # ------------------------------------------------------------ requests in

    def add_request(self, req: TokenizedRequest) -> Optional[RequestError]:
        """Queue it, or return why it can never be served (each refusal its own kind)."""
        error = refusal(req, self.config, self.kv, req.request_id in self._requests)
        if error is not None:
            return error
        request = Request(req)
        request.queued_at = self.clock()
        error = self.structured.attach(request, req)
        if error is not None:
            return error
        self._requests[req.request_id] = request
        self.waiting.add(request)
        return None

    def abort(self, request_ids: list[str]) -> TokenBatch:
        """Remove requests, each with a final delta "abort"; unknown or finished ids are
        ignored."""
        batch = TokenBatch(new_requests=[], deltas=[])
        for req in self._live(request_ids):
            self._finish(req, "abort")
            self._emit(batch, req, finish_reason="abort")
        return batch

    def stop(self, request_ids: list[str]) -> None:
        """Remove requests that ended downstream (``StopMatched``), silently."""
        for req in self._live(request_ids):
            self._finish(req, "stop")

    def _live(self, request_ids: list[str]) -> list[Request]:
        return [self._requests[rid] for rid in request_ids if rid in self._requests]

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def take_ended(self) -> TokenBatch:
        ended, self.ended = self.ended, TokenBatch(new_requests=[], deltas=[])
        return ended

    def _fail(self, batch: TokenBatch, req: Request, detail: ErrorDetail) -> None:
        """End one request with an error the caller sees; the others go on."""
        if not req.is_finished:
            self._finish(req, "error")
        self._emit(batch, req, finish_reason="error", error=detail)

    def is_active(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def block_manager(self) -> BlockManager:
        """The first cache group's pool (the only one of a model without sliding layers)."""
        return self.kv.pools[0]

    # ------------------------------------------------------------ one step

    def schedule(self) -> Optional[StepPlan]:
        """The next step's plan, or None when no request is waiting or running."""
        if self._inflight and not (self.config.overlap and len(self._inflight) == 1):
            raise RuntimeError("schedule() with a step in flight, and overlap off or two in flight")
        if self._inflight and self.kv.min_free() < len(self.running):
            # No preemption while a step runs (its blocks would change under it): each
            # running request must find a block for its next token without evicting anyone.
            return None
        for req in self.structured.poll(self.clock()):
            self._finish(req, "error")
        if not self._requests:
            return None
        step = StepDraft(self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._admit_waiting(step)
        self._add_drafts(step)
        self._ask_proposals(step)
        if not step.scheduled and self.structured.compiling:
            # Only requests whose grammar still compiles: wait for them (the loop wakes
            # when a compile ends or a time limit passes).
            self._finished_ids += step.preempted_ids
            return None
        if not step.scheduled and self._inflight:
            return None  # every running request ends with its token in flight
        if not step.scheduled:
            # Impossible by construction (the oldest request always fits alone);
            # raising beats an engine loop that spins forever.
            raise RuntimeError(f"scheduler made no progress: {self.running} {list(self.waiting)}")
        return self._build_plan(step)

    def _schedule_running(self, step: StepDraft) -> None:
        running = [r for r in self.running if not self._ends_with_pending_token(r)]
        for req in running:  # decodes first
            if step.budget <= 0:
                return
            if req.status is RequestStatus.RUNNING and req.num_tokens - req.num_computed_tokens == 1:
                self._allocate_or_preempt(step, req, 1)
        for req in running:  # then prefill chunks already under way
            if step.budget <= 0:
                return
            if req.status is not RequestStatus.RUNNING or req in step.scheduled:
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            if self.config.enable_chunked_prefill:
                n = min(remaining, step.budget)
            elif remaining <= step.budget or not step.has_prefill:
                n = remaining  # never reached in practice: unchunked prompts finish in one step
            else:
                continue
            self._allocate_or_preempt(step, req, n)

    def _ends_with_pending_token(self, req: Request) -> bool:
        """Its token still in flight reaches max_tokens or max_model_len: update() will end
        it ("length"), so there is nothing to compute for it."""
        return bool(self._inflight) and (req.num_output_tokens >= req.sampling.max_tokens
                                         or req.num_tokens >= self.config.max_model_len)

    def _allocate_or_preempt(self, step: StepDraft, req: Request, n: int) -> None:
        """Give a running request blocks for n more tokens (fewer, with chunked prefill,
        if that is all that is free), preempting the newest running requests until it
        fits; the request itself may be that newest one."""
        kv, bs = self.kv, self.config.block_size
        kv.drop_out_of_window(req, req.num_computed_tokens)
        while True:
            need = blocks_for(req.num_computed_tokens + n, bs) - len(kv.positional(req))
            if need <= 0 or need <= kv.min_free():  # most decode steps need no block
                break
            if self.config.enable_chunked_prefill:
                fit = kv.fit_tokens(req)
                if fit >= 1:
                    n = fit
                    continue
            victim = self.running[-1]
            self._preempt(step, victim)
            if victim is req:
                return
        kv.grow(req, req.num_computed_tokens + n)
        step.add(req, n)

    def _preempt(self, step: StepDraft, req: Request) -> None:
        self.running.remove(req)
        if req in step.scheduled:
            step.budget += step.scheduled.pop(req)
        self.kv.free_all(req)
        req.num_computed_tokens = req.num_verified_tokens = 0
        req.num_cached_blocks = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        if req.worker_num_tokens is not None:
            step.preempted_ids.append(req.request_id)
            req.worker_num_tokens, req.worker_num_blocks = None, 0
        step.preempted = True
        self.num_preemptions += 1

    def _build_plan(self, step: StepDraft) -> StepPlan:
        """The plan of a decided step. Its tokens count as computed from now on, and each
        request that samples gets a PENDING placeholder that update() replaces with the
        real token, so the next step can be planned before this one's result arrives."""
        structured, failures = self.structured.rows(step.scheduled, step.drafts)
        for req, detail in failures:  # it leaves the step and fails alone
            step.budget += step.scheduled.pop(req)
            self._fail(self.ended, req, detail)
        new, cached, new_entries, cached_entries = [], [], [], []
        before, taken, snapshots = [], [], []
        for req, n in step.scheduled.items():
            n -= len(step.drafts.get(req, ()))  # of the request's own tokens
            before += self.kv.take_restores(req)
            for entry, block_hash in self.kv.snapshots_in(req, req.num_computed_tokens,
                                                          req.num_computed_tokens + n):
                taken.append(entry)
                snapshots.append((entry[0], entry[2], block_hash))
            for g, slots in step.draft_snapshots.get(req, ()):  # after the token, each draft
                taken += [[g, req.block_ids[g][0], slot, req.num_computed_tokens + 1 + j]
                          for j, slot in enumerate(slots)]
            samples = req.num_computed_tokens + n == req.num_tokens
            if req.worker_num_tokens is None:
                new.append(NewRequestData(req.request_id, list(req.token_ids),
                                          [list(t) for t in req.block_ids],
                                          req.num_computed_tokens, req.sampling))
                new_entries.append((req, n, samples))
            else:
                cached.append(CachedRequestData(req.request_id,
                                                req.token_ids[req.worker_num_tokens:],
                                                [t[req.worker_num_blocks:] for t in req.block_ids],
                                                req.num_computed_tokens))
                cached_entries.append((req, n, samples))
            req.worker_num_tokens, req.worker_num_blocks = req.num_tokens, len(self.kv.positional(req))
        entries = new_entries + cached_entries  # the plan's order
        for req, n, samples in entries:
            req.num_computed_tokens += n
            if samples:
                req.token_ids.append(PENDING)
        drafts = [step.drafts.get(req, []) for req, _, _ in entries]
        proposals = [step.proposals.get(req, 0) for req, _, _ in entries]
        plan = self._register(StepPlan(step_id=0, new_requests=new, cached_requests=cached,
                                       num_scheduled_tokens=[n + len(d) for (_, n, _), d
                                                             in zip(entries, drafts)],
                                       state_copies_before=before, state_snapshots=taken,
                                       draft_token_ids=drafts if any(drafts) else [],
                                       propose_token_counts=proposals if any(proposals) else [],
                                       **structured), entries, step.preempted_ids)
        if snapshots:
            self._snapshots[plan.step_id] = snapshots
        if step.draft_snapshots:
            self._draft_snapshots[plan.step_id] = step.draft_snapshots
        return plan

    def _register(self, plan: StepPlan, entries: list, preempted_ids: list[str]) -> StepPlan:
        if self._inflight and entries:
            self.num_overlapped_steps += 1
        plan.step_id = self._next_step_id
        self._next_step_id += 1
        plan.finished_request_ids = self._finished_ids + preempted_ids
        self._finished_ids = []
        self._inflight.append((plan, entries))
        return plan

    def oldest_plan(self) -> Optional[StepPlan]:
        """The step in flight that update() takes next (None: none in flight)."""
        return self._inflight[0][0] if self._inflight else None

    def newest_plan(self) -> Optional[StepPlan]:
        return self._inflight[-1][0] if self._inflight else None

    def empty_plan(self) -> StepPlan:
        """A plan that computes nothing (it still delivers finished ids): what the loop sends
        when it promised a next plan (``next_follows``) and nothing can be scheduled."""
        return self._register(StepPlan(step_id=0), [], [])

    def plan_ahead_ok(self) -> bool:
        """Whether the step after the newest plan may be planned before that plan's result
        (the loop then marks it ``next_follows``). The next step's inputs may name tokens
        not sampled yet (PENDING): fine for a plain request, not for one whose grammar mask
        or penalty counts need its last token. (Without chunked prefill, scheduling may have
        to preempt, which a step in flight forbids.)"""
        if not (self.config.overlap and self.config.enable_chunked_prefill and self._inflight
                and self._inflight[-1][1] and self.running):
            return False  # (an empty plan is followed by nothing: no promise chain of them)
        if (self.drafter is not None and len(self.running) <= self.config.speculative_max_batch
                and not all(self.drafter.paused(req.request_id) for req in self.running)):
            return False  # the next step may draft: it waits for this one's tokens
        return not any(samples and (req.grammar is not None or uses_penalties(req.sampling))
                       for req, _n, samples in self._inflight[-1][1])

    # ------------------------------------------------------------ results in

    def update(self, plan: StepPlan, result: StepResult) -> TokenBatch:
        """Apply the oldest step's result: confirm computed tokens, put the sampled tokens
        in place of their placeholders, decide finishes. Requests finished since schedule()
        are skipped."""
        if not self._inflight or self._inflight[0][0].step_id != plan.step_id:
            raise RuntimeError(f"update() for step {plan.step_id}, which is not the oldest in flight")
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} given for step {plan.step_id}")
        entries = self._inflight.popleft()[1]
        for g, slot, block_hash in self._snapshots.pop(plan.step_id, ()):
            self.kv.publish_snapshot(g, slot, None if result.error is not None else block_hash)
        self._end_draft_snapshots(plan, result)
        batch = TokenBatch(new_requests=[], deltas=[])
        if result.error is not None:
            detail = ErrorDetail(ErrorKind.internal, result.error)  # the worker's own why
            for req, _, _ in entries:
                if not req.is_finished:
                    self._fail(batch, req, detail)
            return batch
        index = {rid: i for i, rid in enumerate(result.request_ids)}
        for e, (req, n, samples) in enumerate(entries):
            if req.is_finished:
                continue  # aborted while the step ran: its token is dropped
            req.num_verified_tokens += n
            if not samples:
                self._cache_full_blocks(req)
                continue
            i = index.get(req.request_id)
            if i is None:
                self._fail(batch, req, ErrorDetail(
                    ErrorKind.internal,
                    f"the worker returned no token for request {req.request_id!r}"))
                continue
            token = result.token_ids[i]
            logprob = result.logprobs[i] if i < len(result.logprobs) else None
            assert req.token_ids[req.num_verified_tokens] == PENDING, req
            req.token_ids[req.num_verified_tokens] = token
            self._cache_full_blocks(req)
            try:  # the request's own work (its grammar): a failure ends only this request
                self._after_token(batch, req, token, logprob)
                if plan.draft_token_ids and plan.draft_token_ids[e]:
                    self._after_drafts(batch, req, plan.draft_token_ids[e], token, result, i)
                if (plan.propose_token_counts and i < len(result.proposed_token_ids)
                        and not req.is_finished):
                    self.drafter.offer(req.request_id, req.num_tokens, result.proposed_token_ids[i])
            except Exception as exc:  # noqa: BLE001
                log.exception("request %s failed after token %d", req.request_id, token)
                self._fail(batch, req, ErrorDetail(
                    ErrorKind.internal, f"the scheduler failed on this request's token "
                    f"{token}: {type(exc).__name__}: {exc}"))
        return batch

    def _after_token(self, batch: TokenBatch, req: Request, token: int,
                     logprob: Optional[TokenLogprobs]) -> None:
        grammar = req.grammar
        if grammar is not None and not grammar.accept(token):  # never: the worker applied the mask
            self._fail(batch, req, ErrorDetail(ErrorKind.internal, f"token {token} does not "
                                               f"match the request's {grammar.spec.kind}"))
            return
        is_eos = token in req.eos_token_ids and not req.sampling.ignore_eos
        # A grammar's stop token after a complete answer ends it even with ignore_eos.
        if is_eos or token in req.stop_token_ids or (grammar is not None and grammar.terminated):
            self._finish(req, "stop")  # the stop token is counted but never shown
            self._emit(batch, req, finish_reason="stop", num_hidden_tokens=1)
            return
        reason = None
        num_tokens = req.num_verified_tokens + 1  # this token's; later ones may be in flight
        if (num_tokens - req.num_prompt_tokens >= req.sampling.max_tokens
                or num_tokens >= self.config.max_model_len):
            reason = "length"
            self._finish(req, reason)
        self._emit(batch, req, [token], [logprob] if logprob is not None else [], reason)

    def _cache_full_blocks(self, req: Request) -> None:
        """Publish the blocks this step filled with computed KV."""
        if not self.config.enable_prefix_caching:
            return
        full = req.num_verified_tokens // self.config.block_size
        if full <= req.num_cached_blocks:
            return
        req.update_block_hashes(self.config.block_size, req.num_verified_tokens)
        self.kv.publish(req, req.num_cached_blocks, full)
        req.num_cached_blocks = full

    def _finish(self, req: Request, reason: str) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.structured.compiling.pop(req, None)
        self.kv.free_all(req)
        if self.drafter is not None:
            self.drafter.forget(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self._requests[req.request_id]
        if req.worker_num_tokens is not None:
            self._finished_ids.append(req.request_id)

    def _emit(self, batch: TokenBatch, req: Request, token_ids: Optional[list[int]] = None,
              logprobs: Optional[list] = None, finish_reason: Optional[str] = None,
              error: Optional[ErrorDetail] = None, num_hidden_tokens: int = 0) -> None:
        if not req.announced:
            batch.new_requests.append(req.detok)
            req.announced = True
        batch.deltas.append(TokenDelta(
            req.request_id, token_ids or [], logprobs or [], finish_reason,
            req.num_cached_tokens or 0, error, num_hidden_tokens))

    # ------------------------------------------------------------ introspection

    def stats(self) -> dict:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            **self.kv.stats(),
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "preemptions": self.num_preemptions,
            "overlapped_steps": self.num_overlapped_steps,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError on any inconsistency (for tests and debugging)."""
        for req in self.running:
            assert req.status is RequestStatus.RUNNING and self._requests[req.request_id] is req
            assert self._inflight or PENDING not in req.token_ids, f"{req} has a stale placeholder"
            assert req.num_computed_tokens < req.num_tokens, f"{req} has nothing left to compute"
        for req in self.waiting:
            assert req.status is RequestStatus.WAITING and self._requests[req.request_id] is req
            assert not any(req.block_ids) and req.num_computed_tokens == 0, (
                f"waiting {req} holds KV")
        assert len(self._requests) == len(self.running) + len(self.waiting)
        assert len(self.running) <= self.config.max_num_seqs
        self.kv.check_invariants(self.running, [(g, slot) for held in self._snapshots.values()
                                                for g, slot, _ in held]
                                 + [(g, s) for held in self._draft_snapshots.values()
                                    for pairs in held.values() for g, slots in pairs for s in slots]
                                 + [(g, slot) for req in self.running
                                    for g, slot, _dst in req.state_restores],
                                 self._blocks_ahead())


"""Test harness for the scheduler: a fake paged worker and a step loop (no tests here).

The fake worker keeps what a real rank keeps (per-request tokens, one block table per
cache group, computed count) and a KV "cache" of slots per group. Every computed token
writes (token, digest of its whole prefix) into its slot of every group; each step reads
back, through each group's table, every position its queries attend to (a sliding group:
only its window) and checks each slot, so a block shared by mistake, overwritten by
another request, freed while still in the window or matched from a wrong prefix fails
loudly. The next token is a function of the tokens read back (the full context).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

from pocketllm.proto.messages import (NULL_BLOCK, PENDING, CacheGroup, CacheSpec,
                                      SamplingSpec, StepPlan, StepResult, TokenBatch,
                                      TokenizedRequest, TokenLogprobs)
from pocketllm.scheduler.scheduler import Scheduler, SchedulerConfig
from pocketllm.scheduler.step_loop import StepLoop

VOCAB = 1000


def next_token(tokens: list[int]) -> int:
    tail = tokens[-4:]
    return (sum(t * (i + 3) for i, t in enumerate(tail)) + 7 * len(tokens)) % VOCAB


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, eos: tuple = (),
                 **sampling) -> TokenizedRequest:
    return TokenizedRequest(rid, list(prompt), SamplingSpec(max_tokens=max_tokens, **sampling),
                            eos_token_ids=list(eos))


def config(**kw) -> SchedulerConfig:
    base = dict(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=32,
                max_model_len=256)
    base.update(kw)
    return SchedulerConfig(**base)


def sliding_config(window: int, sliding_blocks: Optional[int] = None, **kw) -> SchedulerConfig:
    """A full group and a sliding group of ``window`` (its pool ``sliding_blocks``)."""
    cfg = config(**kw)
    cfg.cache_groups = [CacheGroup(CacheSpec(), cfg.num_kv_blocks),
                        CacheGroup(CacheSpec("sliding", window),
                                   sliding_blocks or cfg.num_kv_blocks)]
    return cfg


STATE = "state"  # FakeWorker's mark of a recurrent-state group


class FakeWorker:
    def __init__(self, block_size: int, windows: tuple = (None,)):
        self.block_size = block_size
        # per cache group: None = full attention, an int = a sliding window, STATE = one
        # recurrent-state slot per request
        self.windows = windows
        self.kv: dict[tuple[int, int, int], tuple[int, int]] = {}  # (group, block, offset)
        # (group, slot) -> hash of the tokens its state has taken in, in order
        self.states: dict[tuple[int, int], int] = {}
        self.reqs: dict[str, dict] = {}
        self.computed = Counter()  # request id -> tokens computed over its life
        self.fail_next = False
        self.logprobs = False
        self.last_sampled: dict[str, int] = {}  # what a PENDING input of the next step is

    def _slot(self, state: dict, pos: int, group: int = 0) -> tuple[int, int, int]:
        block = state["blocks"][group][pos // self.block_size]
        assert block != NULL_BLOCK, f"position {pos} of group {group} has no block"
        return group, block, pos % self.block_size

    def _first_read(self, group: int, start: int) -> int:
        """The first position a query at ``start`` attends to in this group."""
        window = self.windows[group]
        return 0 if window is None else max(0, start - window + 1)

    def _positional(self) -> list[int]:
        return [g for g, w in enumerate(self.windows) if w != STATE]

    def _advance_states(self, rid: str, state: dict, start: int, n: int) -> None:
        """A chunk through each state group: from zeros at position 0, else from exactly
        the state the request's own earlier tokens left in its slot."""
        tokens = state["tokens"]
        for g, w in enumerate(self.windows):
            if w != STATE:
                continue
            assert len(state["blocks"][g]) == 1, f"{rid}: group {g} table {state['blocks'][g]}"
            slot = (g, state["blocks"][g][0])
            if start == 0:
                self.states[slot] = hash(())
            assert self.states.get(slot) == hash(tuple(tokens[:start])), \
                f"{rid}: the state in slot {slot} is not its first {start} tokens'"
            self.states[slot] = hash(tuple(tokens[:start + n]))

    def _copy_states(self, copies) -> None:
        for g, src, dst in copies:
            assert self.windows[g] == STATE, f"a state copy in group {g}, not a state group"
            self.states[(g, dst)] = self.states.get((g, src))

    def _take_snapshots(self, snapshots, scheduled: dict[str, int]) -> None:
        """The state a slot held once the request computing in it had its positions
        below ``position`` in, taken inside this step's chunk, into the snapshot slot."""
        for g, slot, snapshot, position in snapshots:
            assert self.windows[g] == STATE, f"a state snapshot in group {g}, not a state group"
            [rid] = [rid for rid, n in scheduled.items()
                     if self.reqs[rid]["blocks"][g] == [slot]]
            state = self.reqs[rid]
            end = state["computed"]  # already advanced past this step's chunk
            assert end - scheduled[rid] < position <= end, (rid, position, end)
            self.states[(g, snapshot)] = hash(tuple(state["tokens"][:position]))

    def _check_reads(self, rid: str, state: dict, start: int, end: int) -> None:
        for g in self._positional():
            for pos in range(self._first_read(g, start), end):
                assert self.kv.get(self._slot(state, pos, g)) == self._expected(
                    state["tokens"], pos), f"{rid}: group {g} KV corrupt at {pos}"

    def _expected(self, tokens: list[int], pos: int) -> tuple[int, int]:
        return tokens[pos], hash(tuple(tokens[:pos + 1]))

    def step(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_request_ids:
            assert rid in self.reqs, f"told to drop {rid}, which this rank never held"
            del self.reqs[rid]
        for new in plan.new_requests:
            assert new.request_id not in self.reqs, f"{new.request_id} sent as new twice"
            assert len(new.block_ids) == len(self.windows), new
            state = dict(tokens=list(new.token_ids), blocks=[list(t) for t in new.block_ids],
                         computed=new.num_computed_tokens)
            self.reqs[new.request_id] = state
        for cached in plan.cached_requests:
            state = self.reqs[cached.request_id]
            new_tokens = list(cached.new_token_ids)
            if PENDING in new_tokens:  # planned before the scheduler saw our last token
                assert new_tokens.index(PENDING) == len(new_tokens) - 1, cached
                new_tokens[-1] = self.last_sampled[cached.request_id]
            state["tokens"] += new_tokens
            for table, more in zip(state["blocks"], cached.new_block_ids):
                table += more
            assert cached.num_computed_tokens == state["computed"], cached.request_id
        ids = [r.request_id for r in plan.new_requests] + [r.request_id for r in plan.cached_requests]
        assert len(ids) == len(set(ids)) == len(plan.num_scheduled_tokens)
        if self.fail_next:
            self.fail_next = False
            return StepResult(plan.step_id, error="simulated forward failure")
        self._copy_states(plan.state_copies_before)  # a prefix hit's snapshot into its slot
        samplers = []
        drafts_of = plan.draft_token_ids or [[]] * len(ids)
        assert len(drafts_of) == len(ids)
        drafts = dict(zip(ids, drafts_of))
        for rid, n in zip(ids, plan.num_scheduled_tokens):  # write every slot first...
            state = self.reqs[rid]
            start, tokens = state["computed"], state["tokens"]
            d = drafts[rid]
            n_known = n - len(d)
            assert 1 <= n_known and start + n_known <= len(tokens), \
                f"{rid}: {start}+{n_known} of {len(tokens)}"
            assert not d or start + n_known == len(tokens), f"{rid}: drafts before its end"
            for g in self._positional():
                assert len(state["blocks"][g]) * self.block_size >= start + n, f"{rid}: too few blocks"
            self._check_reads(rid, state, start, start)  # the cached KV the chunk attends to
            self._advance_states(rid, state, start, n_known)
            ext = tokens + d  # a draft's KV is its prefix's, whether or not it is accepted
            for pos in range(start, start + n):
                for g in self._positional():
                    self.kv[self._slot(state, pos, g)] = self._expected(ext, pos)
            state["computed"] += n_known
            self.computed[rid] += n
            if state["computed"] == len(tokens):
                samplers.append(rid)
        self._take_snapshots(plan.state_snapshots, dict(zip(ids, plan.num_scheduled_tokens)))
        out_ids, out_tokens, out_lp, extras = [], [], [], []
        for rid in samplers:  # ...then attend: read each group's context back
            state = self.reqs[rid]
            self._check_reads(rid, state, len(state["tokens"]) - 1, len(state["tokens"]))
            d, tokens = drafts[rid], state["tokens"]
            # each position's token given the drafts before it; drafts accepted while they
            # equal the token sampled before them
            got = [next_token(tokens + d[:j]) for j in range(len(d) + 1)]
            accepted = next((j for j in range(len(d)) if got[j] != d[j]), len(d))
            state["computed"] += accepted
            out_ids.append(rid)
            out_tokens.append(got[0])
            extras.append(got[1:accepted + 1])
            self.last_sampled[rid] = got[accepted]
            out_lp.append(None)
        if self.logprobs:
            out_lp = [TokenLogprobs(-0.5, [t], [-0.5]) for t in out_tokens]
        spec = bool(plan.draft_token_ids)
        return StepResult(plan.step_id, out_ids, out_tokens, out_lp,
                          extra_token_ids=extras if spec else [],
                          extra_logprobs=[[TokenLogprobs(-0.5, [t], [-0.5]) for t in e]
                                          for e in extras] if spec and self.logprobs else [])


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    hidden: int = 0
    cached: int = 0
    error: Optional[str] = None
    error_kind: Optional[str] = None
    prompt_len: int = -1


class Driver:
    """Runs schedule -> worker -> update, checking invariants and the TokenBatch stream."""

    def __init__(self, cfg: SchedulerConfig):
        self.sched = Scheduler(cfg)
        self.worker = FakeWorker(cfg.block_size, tuple(
            g.spec.window if g.spec.kind == "sliding" else STATE if g.spec.kind == "state"
            else None for g in cfg.cache_groups))
        self.outcomes: dict[str, Outcome] = {}
        self.plans: list[StepPlan] = []
        # (plan, result) -> None: fills in what a real worker adds (a draft model's proposals)
        self.before_update: Optional[Callable[[StepPlan, StepResult], None]] = None

    def add(self, req: TokenizedRequest) -> None:
        assert self.sched.add_request(req) is None

    def collect(self, batch: TokenBatch) -> None:
        for d in batch.new_requests:
            assert d.request_id not in self.outcomes, f"{d.request_id} announced twice"
            self.outcomes[d.request_id] = Outcome(prompt_len=d.prompt_len)
        for delta in batch.deltas:
            out = self.outcomes[delta.request_id]  # KeyError: delta before its DetokRequest
            assert out.finish_reason is None, f"{delta.request_id} got a delta after finishing"
            out.tokens += delta.token_ids
            out.finish_reason = delta.finish_reason
            out.hidden += delta.num_hidden_tokens
            out.cached = delta.num_cached_tokens
            out.error = delta.error.message if delta.error is not None else None
            out.error_kind = delta.error.kind if delta.error is not None else None
            if delta.logprobs:
                assert len(delta.logprobs) == len(delta.token_ids)

    def step(self, between: Optional[Callable[[StepPlan], None]] = None) -> Optional[StepPlan]:
        plan = self.sched.schedule()
        if plan is None:
            return None
        self.sched.check_invariants()
        self.plans.append(plan)
        result = self.worker.step(plan)
        if between is not None:
            between(plan)
        if self.before_update is not None:
            self.before_update(plan, result)
        self.collect(self.sched.update(plan, result))
        self.sched.check_invariants()
        return plan

    def run(self, max_steps: int = 5000) -> dict[str, Outcome]:
        for _ in range(max_steps):
            if self.step() is None:
                break
        assert not self.sched.has_unfinished()
        return self.outcomes

    def run_overlapped(self, max_steps: int = 5000,
                       arrivals: Optional[dict[int, list[TokenizedRequest]]] = None
                       ) -> dict[str, Outcome]:
        """Drives the stage's own step order (scheduler/step_loop.py) with overlap: a plan
        marked next_follows is followed by the next before its result is applied. The
        fake worker runs each plan as it is sent; its result waits for update()."""
        arrivals = dict(arrivals or {})
        loop = StepLoop(self.sched, _FakeIO(self))
        self.step_loop = loop
        for n in range(max_steps):
            for req in arrivals.pop(n, []):
                self.add(req)
            if not arrivals and not self.sched.has_unfinished() and self.sched.oldest_plan() is None:
                break
            loop.step()
        assert not self.sched.has_unfinished() and self.sched.oldest_plan() is None
        return self.outcomes


class _FakeIO:
    """The StepLoop's world in a test: plans go to the fake worker, batches to the Driver."""

    def __init__(self, driver: Driver):
        self.d = driver

    def drain(self, block: bool) -> None:
        pass  # arrivals are added between turns; results arrive as plans are sent

    def send_plan(self, plan: StepPlan) -> None:
        self.d.plans.append(plan)
        self.d.sched.check_invariants()
        self.d.step_loop.receive(self.d.worker.step(plan))

    def emit(self, batch: TokenBatch) -> None:
        self.d.collect(batch)

    def report_grammar_errors(self, errors: list) -> None:
        raise AssertionError(f"unexpected grammar errors: {errors}")

    def publish_stats(self, force: bool) -> None:
        self.d.sched.check_invariants()


def solo(req: TokenizedRequest, **cfg) -> Outcome:
    """What a request produces alone, with room to spare."""
    d = Driver(config(**{"num_kv_blocks": 512, "max_model_len": 256, **cfg}))
    d.add(req)
    return d.run()[req.request_id]


def run_matching_solo(d: Driver, reqs: list) -> dict[str, Outcome]:
    """Add every request, run to the end, and check each answer is the one it gets alone."""
    for r in reqs:
        d.add(r)
    outs = d.run()
    for r in reqs:
        assert outs[r.request_id].tokens == solo(r).tokens, r.request_id
    return outs


def random_requests(rng, num_reqs: int) -> list:
    """Requests of a random workload: prompts that share random prefixes of one base."""
    base = [rng.randrange(50) for _ in range(30)]
    return [make_request(f"q{i}", base[:rng.randrange(0, 30)]
                         + [rng.randrange(50) for _ in range(rng.randrange(1, 10))],
                         max_tokens=rng.randrange(1, 30)) for i in range(num_reqs)]


def staggered(rng, reqs: list) -> dict[int, list]:
    """Arrivals for ``Driver.run_overlapped``: half at once, the rest over 20 turns."""
    arrivals = {0: reqs[:len(reqs) // 2 + 1]}
    for r in reqs[len(reqs) // 2 + 1:]:
        arrivals.setdefault(rng.randrange(1, 20), []).append(r)
    return arrivals

"""Scheduler-side constrained decoding, with a stand-in grammar (no xgrammar, no model).

The stand-in "compiles" a spec whose value is a count N into a matcher that allows
tokens 100..109 for N tokens and then only the request's stop ids. A fake worker
samples the lowest allowed token of each bitmask row, so the tests see exactly what
the scheduler sent: rows only for requests that sample, a matcher that survives
preemption, compiles that never stall other requests, and clean failures.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from pocketllm.proto.messages import StructuredSpec
from pocketllm.scheduler.grammar import Grammars
from pocketllm.scheduler.scheduler import Scheduler
from test_scheduler_harness import Driver, FakeWorker, config, make_request

DIGITS = range(100, 110)
EOS = 1


class CountingMatcher:
    def __init__(self, length: int, stop_ids: list[int]):
        self.length, self.stop_ids = length, stop_ids
        self.accepted: list[int] = []
        self.terminated = False

    def allowed(self) -> list[int]:
        return list(DIGITS) if len(self.accepted) < self.length else self.stop_ids

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        words = bitmask.view(np.uint32)
        words[row] = 0
        for t in self.allowed():
            words[row, t // 32] |= np.uint32(1 << (t % 32))

    def accept_token(self, token: int) -> bool:
        if token not in self.allowed():
            return False
        if len(self.accepted) >= self.length:
            self.terminated = True
        else:
            self.accepted.append(token)
        return True

    def is_terminated(self) -> bool:
        return self.terminated


class StandInCompiler:
    """A compiler without xgrammar or a vocabulary: ``compile_fn(spec)`` returns a matcher
    factory, which ``matcher`` calls with the request's stop ids."""

    def __init__(self, compile_fn=None):
        self.compile_fn = compile_fn
        self.ready_at = time.monotonic()  # no vocabulary to set up

    def compile(self, spec: StructuredSpec):
        return self.compile_fn(spec)

    def matcher(self, compiled, stop_ids: list[int]):
        return compiled(stop_ids)


class StandIn(StandInCompiler):
    """"slow" waits for ``release``; "bad" fails; a number N gives N digits."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.calls: list[str] = []

    def compile(self, spec: StructuredSpec):
        self.calls.append(spec.value)
        if spec.value == "slow":
            self.release.wait(30)
            return lambda stop_ids: CountingMatcher(2, stop_ids)
        if spec.value == "bad":
            raise ValueError("invalid regex: the parenthesis is not closed")
        return lambda stop_ids: CountingMatcher(int(spec.value), stop_ids)


class GrammarWorker(FakeWorker):
    """Samples the lowest token each bitmask row allows; checks rows belong to samplers."""

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.masked_steps = 0

    def step(self, plan):
        result = super().step(plan)
        ids = plan.structured_request_ids
        if not ids:
            assert plan.structured_bitmask == b""
            return result
        self.masked_steps += 1
        words = np.frombuffer(plan.structured_bitmask, dtype=np.uint32).reshape(len(ids), -1)
        assert set(ids) <= set(result.request_ids), "a bitmask row for a request that samples nothing"
        for rid, row in zip(ids, words):
            bits = np.unpackbits(row.view(np.uint8), bitorder="little")
            result.token_ids[result.request_ids.index(rid)] = int(np.flatnonzero(bits)[0])
        return result


def make_driver(timeout_s: float = 30.0, **cfg) -> tuple[Driver, StandIn]:
    stand_in = StandIn()
    d = Driver(config(**cfg))
    d.sched = Scheduler(d.sched.config, Grammars(stand_in, 1000, timeout_s))
    d.worker = GrammarWorker(d.sched.config.block_size)
    return d, stand_in


def structured(rid: str, value: str, prompt=(5, 6, 7), max_tokens: int = 30, **kw):
    return make_request(rid, list(prompt), max_tokens=max_tokens, eos=(EOS,),
                        structured=StructuredSpec("regex", value), **kw)


def wait_compiled(d: Driver) -> None:
    for req in list(d.sched.structured.compiling):
        req.grammar.future.exception(timeout=30)  # done (or failed), whatever the result


def test_grammar_shapes_output_and_stop_token_finishes():
    d, _ = make_driver()
    d.add(structured("g", "5"))
    d.add(make_request("plain", [9, 9, 9, 9, 9, 9], max_tokens=10))
    wait_compiled(d)
    out = d.run()
    assert out["g"].tokens == [100] * 5  # the stop token ends it, counted but hidden
    assert out["g"].finish_reason == "stop" and out["g"].hidden == 1
    assert out["plain"].finish_reason == "length"
    # Rows only in steps where the structured request sampled: 5 digits + the stop token.
    assert d.worker.masked_steps == 6
    assert any(not p.structured_request_ids for p in d.plans)


def test_grammar_stop_ids_include_the_requests_stop_token_ids():
    d, _ = make_driver()
    d.add(make_request("g", [5, 6, 7], max_tokens=30, eos=(), stop_token_ids=[3],
                       structured=StructuredSpec("regex", "2")))
    wait_compiled(d)
    out = d.run()["g"]
    assert out.tokens == [100, 100] and out.finish_reason == "stop" and out.hidden == 1


def test_a_compiling_request_waits_while_others_run():
    d, stand_in = make_driver()
    d.add(structured("slow", "slow"))
    d.add(make_request("plain", [1, 2, 3, 4, 5], max_tokens=6))
    while d.step() is not None:
        pass
    assert d.outcomes["plain"].finish_reason == "length"  # finished while "slow" compiled
    assert "slow" not in d.outcomes and d.sched.has_unfinished()
    assert d.sched.schedule() is None  # nothing to run yet: the loop sleeps, it never spins
    stand_in.release.set()
    wait_compiled(d)
    out = d.run()
    assert out["slow"].tokens == [100, 100] and out["slow"].finish_reason == "stop"


def test_compile_past_the_time_limit_fails_only_that_request():
    d, stand_in = make_driver(timeout_s=0.0)
    d.add(structured("slow", "slow"))
    d.add(make_request("plain", [1, 2, 3], max_tokens=3))
    out = d.run()
    stand_in.release.set()
    assert out["plain"].finish_reason == "length"
    assert "slow" not in out  # never scheduled, never announced to the detokenizer
    [(rid, why, param)] = d.sched.structured.errors
    assert rid == "slow" and param == "response_format"
    assert "took longer than 0 s" in why and "structured_output_timeout_s" in why


def test_a_grammar_that_fails_to_compile_is_reported_and_not_cached():
    d, stand_in = make_driver()
    d.add(structured("bad", "bad"))
    wait_compiled(d)
    assert d.sched.schedule() is None and not d.sched.has_unfinished()
    [(rid, why, _)] = d.sched.structured.errors
    assert rid == "bad" and "parenthesis is not closed" in why
    d.add(structured("bad2", "bad"))
    wait_compiled(d)
    assert stand_in.calls == ["bad", "bad"]


def test_compiled_grammars_are_cached_by_kind_and_value():
    d, stand_in = make_driver()
    for i in range(4):  # n=4 choices share one spec
        d.add(structured(f"g{i}", "3", prompt=(5, 6, 7 + i)))
    d.add(structured("other", "4"))
    wait_compiled(d)
    out = d.run()
    assert sorted(stand_in.calls) == ["3", "4"]
    assert all(out[f"g{i}"].tokens == [100] * 3 for i in range(4))
    assert out["other"].tokens == [100] * 4


def test_preemption_keeps_the_matcher():
    # 6 blocks of 4 tokens: three requests growing to 20 tokens each cannot all stay.
    d, _ = make_driver(num_kv_blocks=6, max_num_batched_tokens=64)
    for i in range(3):
        d.add(structured(f"g{i}", "12", prompt=[10 + i] * 7, max_tokens=13))
    wait_compiled(d)
    out = d.run()
    assert d.sched.num_preemptions > 0
    for i in range(3):
        assert out[f"g{i}"].tokens == [100] * 12 and out[f"g{i}"].finish_reason == "stop"


def test_structured_request_without_grammar_support_is_refused():
    sched = Scheduler(config())
    err = sched.add_request(structured("g", "3"))
    assert "structured output" in err.message
    assert (err.kind, err.param) == ("unsupported", "response_format")


def test_abort_of_a_compiling_request():
    d, stand_in = make_driver()
    d.add(structured("slow", "slow"))
    d.sched.abort(["slow"])
    assert not d.sched.has_unfinished() and d.sched.schedule() is None
    stand_in.release.set()



def test_overlap_waits_for_a_structured_requests_token():
    """A grammar's mask for the next step needs this step's token: a step in which a
    structured request samples is never followed by one planned ahead of its result."""
    d, _ = make_driver(overlap=True)
    d.add(structured("g", "6"))
    d.add(make_request("plain", [9, 9, 9, 9, 9, 9], max_tokens=40))
    wait_compiled(d)
    out = d.run_overlapped()
    assert out["g"].tokens == [100] * 6 and out["g"].finish_reason == "stop"
    assert out["plain"].finish_reason == "length"
    samples_g = [p for p in d.plans if "g" in p.structured_request_ids]
    assert samples_g and not any(p.next_follows for p in samples_g)
    assert any(p.next_follows for p in d.plans), "the plain request alone overlaps afterwards"

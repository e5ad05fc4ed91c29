"""Stages never die on a request: each stage object is driven directly with crafted
messages, and a request that fails in it fails alone (a typed error, its state freed)
while the stage goes on and the other request of the same batch is untouched."""

from __future__ import annotations

import time
from collections import OrderedDict

import pytest

from pocketllm.detokenizer.detokenizer import Detokenizer
from pocketllm.proto.messages import (DetokRequest, ErrorKind, GenerateRequest, RequestError,
                                      SamplingSpec, StructuredSpec, TokenBatch, TokenDelta,
                                      TokenizedRequest)
from pocketllm.scheduler.grammar import Grammars, RequestGrammar, XGrammarCompiler
from pocketllm.scheduler.scheduler import Scheduler
from test_detok_incremental import byte_level_bpe
from test_scheduler_grammar import CountingMatcher, GrammarWorker, StandInCompiler
from test_scheduler_harness import Driver, config, make_request

HI = [{"role": "user", "content": "hi"}]

# ---------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizer_stage(tiny_llama):
    from pocketllm.config import EngineArgs
    from pocketllm.model_info import load_model_info
    from pocketllm.tokenizer.stage import TokenizerStage

    return TokenizerStage(load_model_info(EngineArgs(model=tiny_llama)))


def chat(rid: str, **kwargs) -> GenerateRequest:
    return GenerateRequest(rid, SamplingSpec(), messages=HI,
                           chat_options={"add_generation_prompt": True, **kwargs})


@pytest.mark.parametrize("kwargs", [{"bos_token": "x"}, {"messages": []}, {"messages": 1}])
def test_template_kwargs_that_override_the_engines_are_a_400(tokenizer_stage, kwargs):
    out = tokenizer_stage.handle(chat("bad", **kwargs))
    assert isinstance(out, RequestError) and out.request_id == "bad"
    assert (out.kind, out.param) == (ErrorKind.invalid_request, "chat_template_kwargs")
    assert "could not render" in out.message
    assert isinstance(tokenizer_stage.handle(chat("next")), TokenizedRequest)


def test_an_unforeseen_tokenizer_failure_fails_that_request_only(tokenizer_stage):
    real = tokenizer_stage.tokenizer

    class Poisoned:
        def __getattr__(self, name):
            return getattr(real, name)

        def encode(self, text, **kw):
            if "poison" in text:
                raise RuntimeError("the vocabulary met something odd")
            return real.encode(text, **kw)

        def encode_batch(self, texts, **kw):  # what the stage calls (it releases the GIL)
            if any("poison" in t for t in texts):
                raise RuntimeError("the vocabulary met something odd")
            return real.encode_batch(texts, **kw)

    tokenizer_stage.tokenizer = Poisoned()
    try:
        bad = tokenizer_stage.handle(GenerateRequest("p", SamplingSpec(), prompt="poison"))
        good = tokenizer_stage.handle(GenerateRequest("q", SamplingSpec(), prompt="fine"))
    finally:
        tokenizer_stage.tokenizer = real
    assert isinstance(bad, RequestError) and bad.kind == ErrorKind.internal
    assert "RuntimeError: the vocabulary met something odd" in bad.message
    assert isinstance(good, TokenizedRequest) and good.request_id == "q"


# ---------------------------------------------------------------- scheduler


class FailingMatcher(CountingMatcher):
    """``where`` = "fill": its mask cannot be filled; "accept": its token cannot be taken;
    "nothing": it allows no token at all (a grammar that matches no text)."""

    def __init__(self, where: str, stop_ids):
        super().__init__(3, stop_ids)
        self.where = where

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        if self.where == "fill":
            raise RuntimeError("mask exploded")
        super().fill_next_token_bitmask(bitmask, row)
        if self.where == "nothing":
            bitmask[row] = 0

    def accept_token(self, token: int) -> bool:
        if self.where == "accept":
            raise RuntimeError("matcher exploded")
        return super().accept_token(token)


def compile_stand_in(spec: StructuredSpec):
    if spec.value.isdigit():
        return lambda stop_ids: CountingMatcher(int(spec.value), stop_ids)
    return lambda stop_ids: FailingMatcher(spec.value, stop_ids)


def run_collecting(d: Driver) -> dict:
    """Driver.run, plus the final deltas of requests that failed inside schedule()."""
    for _ in range(500):
        plan = d.step()
        d.collect(d.sched.take_ended())
        if plan is None and not d.sched.has_unfinished():
            break
    assert not d.sched.has_unfinished()
    return d.outcomes


@pytest.mark.parametrize("where,kind", [("fill", ErrorKind.internal),
                                        ("nothing", ErrorKind.invalid_request),
                                        ("accept", ErrorKind.internal)])
def test_a_grammar_failure_fails_only_its_request(where, kind):
    d = Driver(config())
    grammars = Grammars(StandInCompiler(compile_stand_in), 1000, 30.0)
    d.sched = Scheduler(d.sched.config, grammars)
    d.worker = GrammarWorker(d.sched.config.block_size)
    d.add(make_request("bad", [5, 6, 7], max_tokens=10, eos=(1,),
                       structured=StructuredSpec("regex", where)))
    d.add(make_request("good", [5, 6, 7], max_tokens=10, eos=(1,),
                       structured=StructuredSpec("regex", "3")))
    d.add(make_request("plain", [9, 9, 9], max_tokens=4))
    for req in list(d.sched.structured.compiling):
        req.grammar.future.result(timeout=30)
    out = run_collecting(d)
    assert out["bad"].finish_reason == "error" and out["bad"].error_kind == kind
    assert out["good"].tokens == [100] * 3 and out["good"].finish_reason == "stop"
    assert out["plain"].finish_reason == "length" and len(out["plain"].tokens) == 4
    assert d.sched.stats()["kv_blocks_used"] == 0
    d.sched.check_invariants()


def test_stop_ids_outside_the_vocabulary_do_not_reach_the_matcher(tiny_llama):
    """json_object with stop_token_ids past the vocabulary or beyond 63 bits killed the
    scheduler (xgrammar refused them); an id the model cannot sample cannot end it either."""
    from pocketllm.config import EngineArgs
    from pocketllm.model_info import load_model_info
    from pocketllm.tokenizer.tokenizer import load_tokenizer

    info = load_model_info(EngineArgs(model=tiny_llama))
    compiler = XGrammarCompiler(lambda: load_tokenizer(info).tokenizer, info.vocab_size,
                                list(info.eos_token_ids))
    grammars = Grammars(compiler, info.vocab_size, 60.0)
    try:
        rg = RequestGrammar(grammars, StructuredSpec("json_object"),
                            [2, info.vocab_size, 300000, 2 ** 63 + 5, 2 ** 64 - 1])
        rg.future.result(timeout=120)
        assert rg.poll(time.monotonic()) is None and rg.ready
        assert rg.stop_ids == [2]
        fields, failures = grammars.bitmask_rows([(type("R", (), {"grammar": rg,
                                                                  "request_id": "r"})(), [])])
        assert failures == [] and fields["structured_request_ids"] == ["r"]
    finally:
        grammars.shutdown()


def test_the_scheduler_loop_fails_a_request_that_cannot_be_queued():
    from pocketllm.proto import codec
    from pocketllm.scheduler.__main__ import SchedulerLoop

    class Sink:
        def __init__(self):
            self.sent = []

        def send(self, data):
            self.sent.append(codec.decoder_for("frontend").decode(data))

    loop = SchedulerLoop.__new__(SchedulerLoop)  # the loop's handle(), without its sockets
    loop.scheduler = Scheduler(config())
    loop.early_aborts = OrderedDict()
    loop.to_frontend = Sink()
    real = loop.scheduler.add_request

    def add_request(req):
        if req.request_id == "odd":
            raise OverflowError("a value no one foresaw")
        return real(req)

    loop.scheduler.add_request = add_request
    loop.handle(make_request("odd", [1, 2]))
    loop.handle(make_request("fine", [1, 2]))
    [err] = loop.to_frontend.sent
    assert err.request_id == "odd" and err.kind == ErrorKind.internal
    assert "OverflowError: a value no one foresaw" in err.message
    assert loop.scheduler.is_active("fine") and not loop.scheduler.is_active("odd")


# ---------------------------------------------------------------- detokenizer


@pytest.fixture()
def detok():
    return Detokenizer(byte_level_bpe())


def test_a_delta_that_fails_fails_only_its_request(detok):
    tok = detok._tokenizer
    ids = tok.encode("hello world").ids
    outs, stopped = detok.process(TokenBatch(
        new_requests=[DetokRequest("bad", 2, SamplingSpec()), DetokRequest("good", 2, SamplingSpec())],
        deltas=[TokenDelta("bad", [2 ** 40]), TokenDelta("good", ids)]))
    bad, good = outs
    assert bad.finished and bad.finish_reason == "error" and bad.error.kind == ErrorKind.internal
    assert "detokenizer" in bad.error.message
    assert stopped == ["bad"]  # the scheduler is told to stop computing it
    assert good.text == "hello world" and not good.finished
    assert detok.num_active() == 1  # the failed request's state is gone
    outs, _ = detok.process(TokenBatch(deltas=[TokenDelta("bad", ids),
                                               TokenDelta("good", [], finish_reason="length")]))
    assert [(o.request_id, o.finished) for o in outs] == [("good", True)]
    assert detok.num_active() == 0


def test_a_request_whose_state_cannot_be_made_fails_alone(detok, monkeypatch):
    import pocketllm.detokenizer.detokenizer as mod

    real = mod.StopMatcher

    def matcher(stop, include):
        if "boom" in stop:
            raise MemoryError("no room for this stop string")
        return real(stop, include)

    monkeypatch.setattr(mod, "StopMatcher", matcher)
    ids = detok._tokenizer.encode("hello").ids
    outs, stopped = detok.process(TokenBatch(
        new_requests=[DetokRequest("bad", 2, SamplingSpec(stop=["boom"])),
                      DetokRequest("good", 2, SamplingSpec())],
        deltas=[TokenDelta("bad", ids), TokenDelta("good", ids, finish_reason="length")]))
    assert [(o.request_id, o.finish_reason) for o in outs] == [("bad", "error"), ("good", "length")]
    assert "MemoryError" in outs[0].error.message and stopped == ["bad"]
    assert outs[1].text == "hello" and detok.num_active() == 0


def test_a_megabyte_stop_string_costs_linear_time(detok):
    """It killed the detokenizer (every proper prefix was kept: a megabyte squared)."""
    tok = detok._tokenizer
    stop = "hello " * ((1 << 20) // 6) + "STOP"
    t0 = time.monotonic()
    outs, _ = detok.process(TokenBatch(
        new_requests=[DetokRequest("big", 2, SamplingSpec(stop=[stop]))],
        deltas=[TokenDelta("big", tok.encode("hello hello world").ids)]))
    outs2, _ = detok.process(TokenBatch(deltas=[TokenDelta("big", [], finish_reason="length")]))
    assert time.monotonic() - t0 < 5
    assert "".join(o.text for o in outs + outs2) == "hello hello world"

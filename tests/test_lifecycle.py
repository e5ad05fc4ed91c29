"""The one request lifecycle (pocketllm/api/lifecycle.py): driven directly over a stand-in
client, then the same request through LLM, AsyncLLM and HTTP, which all run it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pocketllm import SamplingParams
from pocketllm.api.lifecycle import Generation
from pocketllm.api.requests import prompt_request
from pocketllm.errors import EngineDeadError, RequestFailedError, RequestIdInUseError
from pocketllm.proto.messages import RequestOutput, Usage


class StandIn:
    """Records submits and aborts; a test feeds each request's sink by hand."""

    def __init__(self, refuse: str = ""):
        self.sinks: dict = {}
        self.aborted: list[str] = []
        self.refuse = refuse

    def submit(self, req, sink):
        if req.request_id == self.refuse:
            raise RequestIdInUseError("in use", "request_id")
        self.sinks[req.request_id] = sink

    def abort(self, ids):  # like EngineClient.abort: only the requests it holds
        active = [r for r in ids if r in self.sinks]
        self.aborted += active
        return active


def reqs(*ids):
    return [prompt_request("hi", SamplingParams(), rid) for rid in ids]


def out(rid, text, ids, finished=False, usage=None, reason=None):
    return RequestOutput(rid, text, ids, finished, reason or ("length" if finished else None),
                         usage)


def run(coro):
    return asyncio.run(coro)


def test_deltas_accumulate_per_choice_and_each_prompt_counts_once():
    async def go():
        client = StandIn()
        # two prompts, two choices each: a, b of the first prompt, c, d of the second
        async with Generation(client, reqs("a", "b", "c", "d")) as gen:
            client.sinks["a"](out("a", "x", [1]))
            client.sinks["c"](out("c", "y", [2], True, Usage(5, 1, 2)))
            client.sinks["a"](out("a", "z", [3], True, Usage(3, 2)))
            client.sinks["b"](out("b", "w", [4], True, Usage(3, 1)))
            client.sinks["d"](out("d", "", [], True, Usage(5, 0, 2), reason="abort"))
            seen = [item async for item in _drain(gen)]
        assert [i for i, _ in seen] == [0, 2, 0, 1, 3]
        a, b, c, d = gen.outputs
        assert (a.text, a.token_ids, a.finish_reason) == ("xz", [1, 3], "length")
        assert (d.finish_reason, c.usage.cached_tokens) == ("abort", 2)
        assert gen.usage(prompt_count=2).as_dict() == {
            "prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12,
            "prompt_tokens_details": {"cached_tokens": 2}}
        assert client.aborted == []  # all finished: nothing to abort
    run(go())


async def _drain(gen):
    while (item := await gen.next()) is not None:
        yield item


def test_a_failed_choice_raises_its_error_and_aborts_the_others():
    async def go():
        client = StandIn()
        with pytest.raises(EngineDeadError):
            async with Generation(client, reqs("a", "b")) as gen:
                client.sinks["b"](out("b", "t", [1]))
                client.sinks["a"](EngineDeadError("gone"))
                while await gen.next() is not None:
                    pass
        assert gen.outputs[0].finish_reason == "error"
        assert client.aborted == ["b"]
    run(go())


def test_an_error_finish_without_detail_is_a_failure():
    async def go():
        client = StandIn()
        gen = Generation(client, reqs("a"))
        task = asyncio.ensure_future(gen.run())
        await asyncio.sleep(0)
        client.sinks["a"](out("a", "", [], True, reason="error"))
        with pytest.raises(RequestFailedError):
            await task
    run(go())


def test_the_deadline_ends_it_and_aborts_what_runs():
    async def go():
        client = StandIn()
        async with Generation(client, reqs("a", "b"), timeout=0.05) as gen:
            client.sinks["a"](out("a", "x", [1], True, Usage(1, 1)))
            assert (await gen.next())[0] == 0
            assert await gen.next() is None
        assert gen.timed_out and client.aborted == ["b"]
    run(go())


def test_cut_ends_it_without_waiting_for_the_engine():
    async def go():
        client = StandIn()
        async with Generation(client, reqs("a")) as gen:
            gen.cut()
            assert await gen.next() is None
        assert gen.was_cut and not gen.timed_out and client.aborted == ["a"]
    run(go())


def test_a_refused_submit_aborts_the_requests_already_sent():
    async def go():
        client = StandIn(refuse="b")
        with pytest.raises(RequestIdInUseError):
            Generation(client, reqs("a", "b")).submit()
        assert client.aborted == ["a"]
    run(go())


# ---------------------------------------------------------------- the three callers


def test_llm_asyncllm_and_http_give_the_same_output_and_usage(tiny_llama, llm_tiny):
    from pocketllm import AsyncLLM, EngineArgs
    from server_process import ServerProcess

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = "The sea is"
    whole = llm_tiny.generate(prompt, params)[0]
    events = list(llm_tiny.generate_stream(prompt, params))
    assert "".join(e.text for e in events) == whole.text
    assert [t for e in events for t in e.token_ids] == whole.token_ids
    assert events[-1].usage == whole.usage and whole.usage.completion_tokens == 8

    async def via_async():
        async with AsyncLLM(EngineArgs(model=tiny_llama, max_num_batched_tokens=64,
                                       seed=0)) as llm:
            got = (await llm.generate(prompt, params))[0]
            streamed = [e async for e in llm.generate_stream(prompt, params)]
            return got, streamed
    got, streamed = asyncio.run(via_async())
    assert (got.text, got.token_ids, got.usage) == (whole.text, whole.token_ids, whole.usage)
    assert "".join(e.text for e in streamed) == whole.text

    srv = ServerProcess("--model", tiny_llama, "--max-num-batched-tokens", "64", "--seed", "0")
    try:
        body = {"prompt": prompt, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
    finally:
        assert srv.stop() == 0
    assert r["choices"][0]["text"] == whole.text
    assert r["choices"][0]["finish_reason"] == whole.finish_reason
    assert r["usage"] == whole.usage.as_dict()

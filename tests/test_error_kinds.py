"""Typed errors end to end: every error kind reaches the caller as its own exception (LLM,
AsyncLLM) and its own HTTP status and OpenAI type/code (the server), from one table.

Three layers: the kinds a real engine produces, through LLM, AsyncLLM and HTTP; every kind
injected on the frontend's socket of a real engine (so the client's mapping is tested
for a refusal and for a failure after the request started); every kind through the real
aiohttp app over a stand-in engine (the server's answer, whole and streamed).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import zmq

from pocketllm import SamplingParams
from pocketllm.errors import (ERRORS, EngineDeadError, InvalidRequestError, PromptTooLongError,
                              RateLimitedError, RequestFailedError, RequestIdInUseError,
                              RequestNotFoundError, RequestTimeoutError, UnsupportedFeatureError)
from pocketllm.proto import codec, endpoints
from pocketllm.proto.messages import ErrorDetail, ErrorKind, RequestError, RequestOutput

# The contract, written out (not read back from the table under test).
EXPECTED = {
    ErrorKind.invalid_request: (InvalidRequestError, 400, "invalid_request_error", None),
    ErrorKind.too_long: (PromptTooLongError, 400, "invalid_request_error",
                         "context_length_exceeded"),
    ErrorKind.unsupported: (UnsupportedFeatureError, 400, "invalid_request_error", "unsupported"),
    ErrorKind.not_found: (RequestNotFoundError, 404, "invalid_request_error", "not_found"),
    ErrorKind.conflict: (RequestIdInUseError, 409, "invalid_request_error", "request_id_in_use"),
    ErrorKind.rate_limited: (RateLimitedError, 429, "requests", "rate_limit_exceeded"),
    ErrorKind.timeout: (RequestTimeoutError, 504, "timeout", "timeout"),
    ErrorKind.internal: (RequestFailedError, 500, "server_error", "internal_error"),
    ErrorKind.engine_dead: (EngineDeadError, 503, "service_unavailable", "engine_dead"),
}

LONG = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
NOTHING = {"type": "regex", "regex": "[^\\x00-\\U0010FFFF]"}  # a grammar that matches no text


def test_the_table_covers_every_kind_once():
    assert set(ERRORS) == set(ErrorKind) == set(EXPECTED)
    for kind, (cls, status, type_, code) in EXPECTED.items():
        spec = ERRORS[kind]
        assert (spec.cls, spec.status, spec.type, spec.code) == (cls, status, type_, code)
        assert cls.kind is kind  # each class names its own kind
    assert len({spec.cls for spec in ERRORS.values()}) == len(ERRORS)


# ---------------------------------------------------------------- what a real engine produces


def test_kinds_the_engine_produces_through_llm(llm_tiny):
    with pytest.raises(InvalidRequestError) as e:
        llm_tiny.generate([[10 ** 6]])
    assert e.value.param == "prompt" and "outside the vocabulary" in str(e.value)
    with pytest.raises(PromptTooLongError) as e:
        llm_tiny.generate("word " * 600)
    assert e.value.param == "prompt"
    with pytest.raises(UnsupportedFeatureError):
        llm_tiny.chat([{"role": "user", "content": "hi"}], reasoning_effort="high")
    # After the request started: its grammar can match nothing (found by the scheduler).
    with pytest.raises(InvalidRequestError) as e:
        llm_tiny.generate("Go:", SamplingParams(max_tokens=5, response_format=NOTHING))
    assert e.value.param == "response_format" and "can match no text" in str(e.value)
    stream = llm_tiny.generate_stream("Go on", LONG, request_id="twice")
    next(stream)
    with pytest.raises(RequestIdInUseError) as e:
        llm_tiny.generate_stream("Go on", LONG, request_id="twice")
    assert e.value.param == "request_id"
    stream.close()
    assert llm_tiny.generate("still fine", SamplingParams(max_tokens=2))[0].finished


def test_a_request_that_cannot_be_encoded_leaves_no_id_behind(llm_tiny):
    """The edge refuses such values first; the client must hold even when it misses one."""
    import msgspec

    from pocketllm.api.requests import prompt_request

    req = prompt_request("hi", SamplingParams(max_tokens=2), "seedy")
    bad = msgspec.structs.replace(req, sampling=msgspec.structs.replace(req.sampling,
                                                                        seed=2 ** 64))
    with pytest.raises(InvalidRequestError) as e:
        llm_tiny._client.submit(bad, lambda item: None)
    assert "64 bits" in str(e.value)
    assert not llm_tiny._client.is_active("seedy")
    out = list(llm_tiny.generate_stream("hi", SamplingParams(max_tokens=2), request_id="seedy"))
    assert out[-1].finished  # the id was free to use again


def test_kinds_the_engine_produces_through_async_llm(tiny_llama):
    from pocketllm import AsyncLLM, EngineArgs

    async def run():
        async with AsyncLLM(EngineArgs(model=tiny_llama, max_num_batched_tokens=64)) as llm:
            with pytest.raises(InvalidRequestError):
                await llm.generate([[10 ** 6]])
            with pytest.raises(PromptTooLongError):
                await llm.generate("word " * 600)
            with pytest.raises(UnsupportedFeatureError):
                await llm.chat([{"role": "user", "content": "hi"}], reasoning_effort="high")
            with pytest.raises(InvalidRequestError) as e:
                await llm.generate("Go:", SamplingParams(max_tokens=5, response_format=NOTHING))
            assert e.value.param == "response_format"
            stream = llm.generate_stream("Go on", LONG, request_id="twice")
            await stream.__anext__()
            with pytest.raises(RequestIdInUseError):
                await llm.generate_stream("Go on", LONG, request_id="twice").__anext__()
            await stream.aclose()
            # every kind injected, as in the LLM test below
            for kind, (cls, *_rest) in EXPECTED.items():
                for started in (False, True):
                    rid = f"inject-{kind}-{started}"
                    stream = llm.generate_stream("Go on", LONG, request_id=rid)
                    await stream.__anext__()
                    inject(llm.client, rid, kind, started)
                    with pytest.raises(cls) as e:
                        async for _ in stream:
                            pass
                    check_injected(e.value, rid, kind)
            assert (await llm.generate("fine", SamplingParams(max_tokens=2)))[0].finished

    asyncio.run(run())


# ---------------------------------------------------------------- every kind, injected


def inject(client, rid: str, kind: ErrorKind, started: bool) -> None:
    """What a stage sends when it fails ``rid``: a refusal, or a final errored output."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(endpoints.frontend(client.supervisor.run_dir))
    detail = ErrorDetail(kind, f"injected {kind}", "some_param")
    msg = (RequestOutput(rid, "", [], finished=True, finish_reason="error", error=detail)
           if started else RequestError(rid, detail.message, kind=kind, param=detail.param))
    sock.send(codec.encode(msg))
    sock.close(linger=1000)


def check_injected(err, rid: str, kind: ErrorKind) -> None:
    assert type(err) is EXPECTED[kind][0]
    assert str(err) == f"injected {kind}" and err.param == "some_param"
    assert err.request_id == rid


@pytest.mark.parametrize("started", [False, True], ids=["refused", "after-start"])
def test_every_kind_reaches_llm_as_its_exception(llm_tiny, started):
    for kind, (cls, *_rest) in EXPECTED.items():
        rid = f"inject-{kind}-{started}"
        stream = llm_tiny.generate_stream("Go on", LONG, request_id=rid)
        next(stream)
        inject(llm_tiny._client, rid, kind, started)
        with pytest.raises(cls) as e:
            for _ in stream:
                pass
        check_injected(e.value, rid, kind)
        assert not llm_tiny._client.is_active(rid)


# ---------------------------------------------------------------- every kind over HTTP


class StandInEngine:
    """The part of EngineClient the server uses; every request fails with ``kind``."""

    def __init__(self, kind: ErrorKind, started: bool):
        from pocketllm.protocol.limits import DEFAULT_LIMITS

        self.kind, self.started = kind, started
        self.limits = DEFAULT_LIMITS

    def submit(self, req, sink) -> None:
        from pocketllm.errors import error_from_wire

        if self.started:  # one delta, then the failure
            sink(RequestOutput(req.request_id, "partial", [5]))
        sink(error_from_wire(RequestError(req.request_id, f"failed as {self.kind}",
                                          kind=self.kind, param="the_param")))

    def abort(self, ids):
        return []


async def _post(kind: ErrorKind, started: bool, stream: bool):
    from aiohttp.test_utils import TestServer

    from pocketllm.server.app import ServerState, build_app

    state = ServerState(model_name="m", client=StandInEngine(kind, started))
    server = TestServer(build_app(state))
    await server.start_server()
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            return await http.post(f"http://127.0.0.1:{server.port}/v1/completions",
                                   json={"prompt": "x", "stream": stream})
    finally:
        await server.close()


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_every_kind_has_its_http_answer(kind):
    _cls, status, type_, code = EXPECTED[kind]
    r = asyncio.run(_post(kind, started=False, stream=False))
    assert r.status_code == status, r.text
    assert r.json() == {"error": {"message": f"failed as {kind}", "type": type_,
                                  "param": "the_param", "code": code}}
    # Streamed, after the first delta went out: the stream ends with the same error event.
    r = asyncio.run(_post(kind, started=True, stream=True))
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {"error": {"message": f"failed as {kind}", "type": type_,
                                                "param": "the_param", "code": code}}


def test_rate_limited_answers_carry_retry_after():
    from pocketllm.server.app import error_answer

    resp = error_answer(RateLimitedError("slow down", retry_after=2.4))
    assert resp.status == 429 and resp.headers["Retry-After"] == "2"
    assert json.loads(resp.body)["error"]["code"] == "rate_limit_exceeded"


def test_a_bug_is_a_500_in_the_openai_shape():
    from pocketllm.server.app import error_answer

    resp = error_answer(KeyError("oops"))
    assert resp.status == 500
    assert json.loads(resp.body)["error"]["type"] == "server_error"

"""No request's stage work holds up another's admission.

A long prompt is sent to the embedded default and beside it a small streaming request:
the small one's time to first token must stay near its time alone. A grammar whose
build takes a minute is tested on the tokenizer loop in process (the edge refuses the
schemas known to build that long). Before the tokenizer stage ran its work on a pool
with grammar checks off its loop, a schema nested 900 levels delayed such a request by
39.7 s and a 7 MB prompt by 9.7 s. Numbers: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest

from server_process import ServerProcess

@pytest.fixture(scope="module")
def server(default_model_path):
    srv = ServerProcess()  # no --model: the embedded default
    yield srv
    assert srv.stop() == 0


def ttft(url: str) -> float:
    """Seconds from sending a small streaming chat request to its first token."""
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2,
            "stream": True, "temperature": 0}
    t0 = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    return time.monotonic() - t0
    raise AssertionError("no token came")


def alone(url: str) -> float:
    ttft(url)  # warm
    return statistics.median(ttft(url) for _ in range(3))


def beside(url: str, send) -> tuple[float, object]:
    """The small request's TTFT while ``send`` (a blocking call) runs on another thread."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", send()))
    t.start()
    time.sleep(0.3)  # the big one is in the tokenizer stage by now
    small = ttft(url)
    t.join(120)
    return small, out.get("r")


def bound(base: float) -> float:
    # Generous for a loaded machine: the neighbour competes for the CPU, but must not block.
    return 3 * base + 2.0


def test_a_grammar_that_builds_for_long_does_not_delay_a_small_request(tiny_llama):
    # The edge now refuses the schemas known to build for minutes (nested past 32 levels),
    # so the build is a stand-in that takes 60 s: the loop must answer the small request
    # at once and fail the slow one at its limit.
    import zmq

    from pocketllm import EngineArgs
    from pocketllm.model_info import load_model_info
    from pocketllm.proto import codec
    from pocketllm.proto.messages import (GenerateRequest, RequestError, SamplingSpec, Shutdown,
                                          StructuredSpec, TokenizedRequest)
    from pocketllm.tokenizer.grammar_checks import GrammarChecks
    from pocketllm.tokenizer.loop import TokenizerLoop
    from pocketllm.tokenizer.stage import TokenizerStage

    release = threading.Event()
    stage = TokenizerStage(load_model_info(EngineArgs(model=tiny_llama)))
    stage.grammar_checks = GrammarChecks(1.0, check=lambda spec: release.wait(60) and None)
    ctx = zmq.Context()
    inbox, sched, front, send = (ctx.socket(zmq.PULL), ctx.socket(zmq.PULL),
                                 ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH))
    inbox.bind("inproc://tok"), sched.bind("inproc://sched"), front.bind("inproc://front")
    send.connect("inproc://tok")
    out_s, out_f = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    out_s.connect("inproc://sched"), out_f.connect("inproc://front")
    loop = TokenizerLoop(stage, inbox, out_s, out_f)
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    try:
        slow = SamplingSpec(max_tokens=4, structured=StructuredSpec("regex", "a+"))
        t0 = time.monotonic()
        send.send(codec.encode(GenerateRequest("slow", slow, prompt="x")))
        send.send(codec.encode(GenerateRequest("small", SamplingSpec(max_tokens=2), prompt="hi")))
        assert sched.poll(5000), "the small request did not come out"
        small = codec.decoder_for("scheduler").decode(sched.recv())
        small_s = time.monotonic() - t0
        assert isinstance(small, TokenizedRequest) and small.request_id == "small"
        assert front.poll(10000), "the slow request was not failed at its limit"
        err = codec.decoder_for("frontend").decode(front.recv())
        slow_s = time.monotonic() - t0
        assert isinstance(err, RequestError) and err.request_id == "slow"
        assert "took longer than 1 s" in err.message and err.param == "response_format"
        print(f"\nbeside a 60 s grammar build: small request out after {small_s:.3f} s, "
              f"the slow one failed after {slow_s:.2f} s")
        assert small_s < 2.0 and 1.0 <= slow_s < 6.0
    finally:
        release.set()
        send.send(codec.encode(Shutdown()))
        runner.join(5)
        for sock in (inbox, sched, front, send, out_s, out_f):
            sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("chars", [900_000, 240_000])
def test_a_huge_prompt_does_not_delay_a_small_request(server, chars):
    # Both pass the edge's 1,000,000-character limit. 900k is refused by its length alone
    # (over 8192 tokens x 31 characters, the longest token); 240k must be tokenized
    # (about 60k tokens, over max_model_len) and is refused after.
    base = alone(server.url)
    prompt = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]

    def send():
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": prompt, "max_tokens": 2})
        return r, time.monotonic() - t0

    small, (r, big_s) = beside(server.url, send)
    print(f"\n{chars} chars beside: small TTFT {small:.3f} s (alone {base:.3f} s); "
          f"prompt refused after {big_s:.2f} s")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert small < bound(base), (small, base)


def test_grammar_checks_time_out_share_builds_and_cache_answers():
    from pocketllm.proto.messages import StructuredSpec
    from pocketllm.tokenizer.grammar_checks import GrammarChecks

    release, calls = threading.Event(), []

    def check(spec):
        calls.append(spec.value)
        if spec.value == "slow":
            release.wait(30)
        return None if spec.value != "bad" else ("invalid_request", "bad grammar")

    checks = GrammarChecks(0.3, check=check)
    slow, fast = StructuredSpec("regex", "slow"), StructuredSpec("regex", "bad")
    t0 = time.monotonic()
    kind, why = checks.answer(slow)
    assert kind == "invalid_request" and "took longer than 0.3 s" in why
    assert time.monotonic() - t0 < 5
    assert checks.answer(fast) == ("invalid_request", "bad grammar")  # the other thread
    t0 = time.monotonic()
    assert "took longer" in checks.answer(slow)[1]  # still building: refused at once
    assert time.monotonic() - t0 < 0.2
    release.set()
    deadline = time.monotonic() + 5
    while checks.answer(slow) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert checks.answer(slow) is None and checks.answer(fast)[1] == "bad grammar"
    assert calls.count("slow") == 1 and calls.count("bad") == 1  # answers are cached

"""No request's stage work holds up another's admission (the embedded default model).

A pathological JSON schema (building its grammar takes many seconds) or a huge prompt
is sent, and beside it a small streaming request: the small one's time to first
token must stay near its time alone. Before the tokenizer stage ran its work on a
pool with grammar checks off its loop, a schema nested 900 levels delayed such a
request by 39.7 s and a 7 MB prompt by 9.7 s. Numbers: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest

from server_process import ServerProcess

GRAMMAR_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--structured-output-timeout", str(GRAMMAR_TIMEOUT_S))
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


def nested_schema(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


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


def test_a_pathological_schema_does_not_delay_a_small_request(server):
    base = alone(server.url)
    # xgrammar's first import (with torch) is a one-time cost outside every time limit.
    warm = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "response_format": {"type": "json_object"}})
    assert warm.status_code == 200, warm.text
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "deep", "schema": nested_schema(300)}}}

    def send():
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        return r, time.monotonic() - t0

    small, (r, slow_s) = beside(server.url, send)
    print(f"\nschema beside: small TTFT {small:.3f} s (alone {base:.3f} s); "
          f"schema refused after {slow_s:.1f} s")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and "took longer" in err["message"], err
    assert slow_s < GRAMMAR_TIMEOUT_S + 5 + 2 * base  # the limit, not the build (~12 s idle)
    assert small < bound(base), (small, base)
    # Sent again while its build still runs: refused at once, no second build queued.
    t0 = time.monotonic()
    again = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert again.status_code == 400 and time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("chars", [7_000_000, 240_000])
def test_a_huge_prompt_does_not_delay_a_small_request(server, chars):
    # 7 MB is refused by its length alone; 240k characters must be tokenized (about 60k
    # tokens, over max_model_len) and is refused after.
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

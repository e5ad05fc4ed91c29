"""Admission: 429 limits per server and per client, a fair queue across clients, the max_tokens
cap and the default request timeout (docs/api.md "Admission")."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from pocketllm.proto.messages import SamplingSpec, TokenizedRequest
from pocketllm.server.admission import Admission, AdmissionLimits, RateLimited
from server_process import ServerProcess
from test_scheduler_harness import Driver, config

# ---------------------------------------------------------------- the counters


def test_limits_per_server_and_per_client_and_release():
    adm = Admission(AdmissionLimits(max_requests=3, max_choices=10, max_client_requests=2,
                                    max_client_choices=6))
    a1 = adm.admit("a", 4)
    adm.admit("a", 2)
    with pytest.raises(RateLimited) as e:  # a third request of a
        adm.admit("a", 1)
    assert e.value.code == "client_busy" and e.value.retry_after_s == 1
    b1 = adm.admit("b", 3)  # another client is not held back by a
    with pytest.raises(RateLimited) as e:  # 3 requests in the server
        adm.admit("c", 1)
    assert e.value.code == "server_busy"
    adm.release(b1)
    adm.release(b1)  # twice is once
    with pytest.raises(RateLimited) as e:  # 4 + 2 + 5 choices > 10
        adm.admit("c", 5)
    assert e.value.code == "server_busy"
    adm.admit("c", 4)
    adm.release(a1)
    assert adm.requests == 2 and adm.choices == 6 and set(adm.by_client) == {"a", "c"}


def test_a_request_that_can_never_fit_is_a_400_not_a_429():
    from pocketllm.errors import InvalidRequestError

    adm = Admission(AdmissionLimits(max_client_choices=8))
    with pytest.raises(InvalidRequestError) as e:
        adm.admit("a", 9)
    assert e.value.param == "n"
    unlimited = Admission(AdmissionLimits(0, 0, 0, 0))  # 0 turns each limit off
    for _ in range(1000):
        unlimited.admit("a", 128)


# ---------------------------------------------------------------- the fair queue


def _req(rid: str, client: str, max_tokens: int = 3) -> TokenizedRequest:
    return TokenizedRequest(rid, [1, 2, 3], SamplingSpec(max_tokens=max_tokens), client=client)


def _admission_order(d: Driver) -> list[str]:
    order = []
    while d.sched.has_unfinished():
        plan = d.step()
        order += [r.request_id for r in plan.new_requests]
    return order


def test_clients_take_turns_in_the_waiting_queue():
    d = Driver(config(max_num_seqs=1))
    for i in range(6):
        d.add(_req(f"a{i}", "flood"))
    d.step()  # a0 runs
    d.add(_req("b0", "small"))
    d.add(_req("b1", "small"))
    d.add(_req("c0", "late"))
    order = _admission_order(d)
    # a0 was running; then the clients alternate instead of b and c waiting behind a1..a5
    assert order == ["a1", "b0", "c0", "a2", "b1", "a3", "a4", "a5"], order


def test_one_client_is_first_come_first_served():
    d = Driver(config(max_num_seqs=2))
    for i in range(5):
        d.add(_req(f"r{i}", "only"))
    d.step()
    for i in range(5, 8):
        d.add(_req(f"r{i}", "only"))
    assert _admission_order(d) == [f"r{i}" for i in range(2, 8)]


def test_an_idle_client_saves_no_credit():
    d = Driver(config(max_num_seqs=1))
    d.add(_req("b0", "b"))  # b's turn, long ago
    for i in range(4):
        d.add(_req(f"a{i}", "a"))
    seen = []
    while "a1" not in seen:
        seen += [r.request_id for r in d.step().new_requests]
    assert seen == ["b0", "a0", "a1"]
    d.add(_req("b1", "b"))
    d.add(_req("b2", "b"))
    # b starts from where the line is, not from its old turn: no burst of b's
    assert _admission_order(d) == ["a2", "b1", "a3", "b2"]


# ---------------------------------------------------------------- max_tokens cap, timeout


@pytest.fixture(scope="module")
def tiny_stage(tiny_llama):
    from pocketllm import EngineArgs
    from pocketllm.model_info import load_model_info
    from pocketllm.tokenizer.stage import TokenizerStage

    return TokenizerStage(load_model_info(EngineArgs(model=tiny_llama, max_model_len=4096)))


def _completion(prompt: str, max_tokens: int):
    from pocketllm.proto.messages import GenerateRequest

    return GenerateRequest("r", SamplingSpec(max_tokens=max_tokens), prompt=prompt)


def test_max_tokens_above_the_cap_is_refused_and_the_default_is_the_context(tiny_stage):
    out = tiny_stage.handle(_completion("hello", 10 ** 6))
    assert out.kind == "invalid_request" and out.param == "max_tokens", out
    assert "too large" in out.message and "4096" in out.message
    ok = tiny_stage.handle(_completion("hello", 4095))  # within the cap: clamped to the room
    assert ok.sampling.max_tokens == 4096 - len(ok.prompt_token_ids)
    unset = tiny_stage.handle(_completion("hello", 0))  # absent: up to the context
    assert unset.sampling.max_tokens == 4096 - len(unset.prompt_token_ids)


def test_max_output_tokens_lowers_the_cap(tiny_llama):
    from pocketllm import EngineArgs
    from pocketllm.model_info import load_model_info
    from pocketllm.tokenizer.stage import TokenizerStage

    stage = TokenizerStage(load_model_info(EngineArgs(model=tiny_llama)), max_output_tokens=10)
    assert stage.handle(_completion("hi", 11)).param == "max_tokens"
    assert stage.handle(_completion("hi", 10)).sampling.max_tokens == 10
    assert stage.handle(_completion("hi", 0)).sampling.max_tokens == 10


def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing(tiny_stage):
    text = "word " * (tiny_stage.max_prompt_chars // 5 + 1)
    t0 = time.monotonic()
    out = tiny_stage.handle(_completion(text, 4))
    assert out.kind == "too_long" and "characters" in out.message, out
    assert time.monotonic() - t0 < 0.5
    assert tiny_stage.max_prompt_chars < 20 * 4096 * 64  # a real bound, not infinity


def test_request_timeout_defaults_to_600_s_and_0_means_none():
    from pocketllm.cli import build_parser
    from pocketllm.server.serve import ServeOptions
    from pocketllm.server.streaming import ChoiceGroup

    assert build_parser().parse_args(["serve"]).request_timeout == 600.0
    assert ServeOptions().request_timeout == 600.0
    parsed = SimpleNamespace(choices=[SimpleNamespace(request_id="r-0")])
    for timeout, bounded in ((600.0, True), (0.0, False)):
        state = SimpleNamespace(metrics=None, request_timeout=timeout)
        group = ChoiceGroup(state, None, parsed, "completion", "r")
        assert (group.gen.deadline is not None) is bounded


# ---------------------------------------------------------------- over HTTP


def _client(address: str) -> httpx.Client:
    """A client whose connections come from ``address`` (another loopback address is
    another client to the server)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=120)


LONG = {"prompt": "hold", "max_tokens": 3000, "ignore_eos": True, "stream": True}


class Held:
    """A streaming request kept open (admitted, holding its slot) until closed."""

    def __init__(self, client: httpx.Client, url: str, body: dict):
        self.cm = client.stream("POST", url + "/v1/completions", json=body)
        self.resp = self.cm.__enter__()
        assert self.resp.status_code == 200, self.resp.read()

    def close(self):
        self.cm.__exit__(None, None, None)


@pytest.fixture(scope="module")
def limited_server(tiny_llama):
    srv = ServerProcess("--model", tiny_llama, "--max-model-len", "4096", "--max-num-seqs", "4",
                        "--max-requests", "4", "--max-choices", "64",
                        "--max-requests-per-client", "2", "--max-choices-per-client", "16")
    yield srv
    assert srv.stop() == 0


def _assert_429(r: httpx.Response, code: str):
    assert r.status_code == 429, r.text
    assert r.headers["Retry-After"] == "1"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "requests" and err["code"] == "rate_limit_exceeded", err
    assert {"server_busy": "the server is at its limit",
            "client_busy": "this client already has"}[code] in err["message"], err


def test_429_per_client_then_per_server_with_retry_after(limited_server):
    url = limited_server.url
    a, b, c = _client("127.0.0.1"), _client("127.0.0.2"), _client("127.0.0.3")
    held = [Held(a, url, LONG), Held(a, url, LONG)]
    try:
        _assert_429(a.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}),
                    "client_busy")
        r = b.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text  # another client is served meanwhile
        too_many = b.post(url + "/v1/completions", json={"prompt": "x", "n": 17})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        held += [Held(b, url, LONG), Held(b, url, LONG)]
        _assert_429(c.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}),
                    "server_busy")
    finally:
        for h in held:
            h.close()
    deadline = time.monotonic() + 30  # closed streams release their slots
    while time.monotonic() < deadline:
        r = c.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        if r.status_code == 200:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text


def _waiting(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("pocketllm_requests_waiting"):
            return float(line.split()[-1])
    return 0.0


def test_a_flooding_client_does_not_starve_a_small_one(tiny_llama):
    # Two seats; the flood queues 32 choices. First come first served, the small request
    # would wait for ~30 of them; taking turns, it waits for about one seat to free.
    srv = ServerProcess("--model", tiny_llama, "--max-num-seqs", "2", "--max-model-len", "1024")
    try:
        finishes: list[float] = []
        lock = threading.Lock()

        def flood(i: int):
            body = {"prompt": f"flood {i}", "n": 8, "max_tokens": 96, "ignore_eos": True,
                    "stream": True}
            with _client("127.0.0.1") as a, a.stream("POST", srv.url + "/v1/completions",
                                                      json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for ch in json.loads(line[6:])["choices"]:
                            if ch["finish_reason"] is not None:
                                with lock:
                                    finishes.append(time.monotonic())

        threads = [threading.Thread(target=flood, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while _waiting(srv.url) < 24 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _waiting(srv.url) >= 24, "the flood did not queue"
        t0 = time.monotonic()
        first = None
        with _client("127.0.0.2") as b, b.stream(
                "POST", srv.url + "/v1/completions",
                json={"prompt": "small", "max_tokens": 2, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.monotonic()
        done = time.monotonic()
        for t in threads:
            t.join(120)
        with lock:
            # Counted against the small request's first token, which reaches this client
            # through the same path as the flood's: its own HTTP round trip is left out.
            before = sum(1 for f in finishes if f < first)
            total, flood_s = len(finishes), max(finishes) - t0
        assert total == 32
        print(f"\nsmall request: {done - t0:.2f} s, after {before} of the flood's 32 choices "
              f"(the flood took {flood_s:.2f} s)")
        # Served after about one seat freed, not after the flood's queue: first come first
        # served would finish the >= 24 queued choices first. The bound leaves room for the
        # choices that finish while the small request is on its way in on a loaded machine.
        assert before <= 8, f"{before} flood choices finished before the small request"
        assert done - t0 < flood_s / 3, (done - t0, flood_s)
    finally:
        assert srv.stop() == 0

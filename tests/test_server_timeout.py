"""--request-timeout: the deadline is the request's, shared by its choices."""

from __future__ import annotations

import time

import httpx
import pytest

from server_process import ServerProcess

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def slow_server(tiny_llama):
    # One seat: the choices of a request run one after another, so a deadline cuts the list.
    srv = ServerProcess("--model", tiny_llama, "--max-num-seqs", "1", "--max-model-len", "32768",
                        "--request-timeout", str(TIMEOUT_S))
    yield srv
    assert srv.stop() == 0


def decode_rate(srv: ServerProcess) -> float:
    """Tokens per second of one sequence on this machine, now: the test sizes its work
    from it, so a loaded CI machine cuts the list as surely as a quiet one."""
    httpx.post(srv.url + "/v1/completions", timeout=60,
               json={"prompt": "warm", "max_tokens": 16, "ignore_eos": True})
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/v1/completions", timeout=60,
                   json={"prompt": "probe", "max_tokens": 100, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return 100 / (time.monotonic() - t0)


def test_deadline_returns_the_choices_that_finished(slow_server):
    # One choice takes about an eighth of the deadline; all of them would take eight deadlines.
    per_choice = max(4, int(decode_rate(slow_server) * TIMEOUT_S / 8))
    r = httpx.post(slow_server.url + "/v1/completions", timeout=60, json={
        "prompt": "tick", "n": 64, "max_tokens": per_choice, "ignore_eos": True,
        "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert 1 <= len(choices) < 64
    assert all(c["finish_reason"] == "length" for c in choices)
    assert r.json()["usage"]["completion_tokens"] == per_choice * len(choices)


def test_deadline_with_nothing_finished_is_504(slow_server):
    # One choice would take four deadlines.
    tokens = min(32000, int(decode_rate(slow_server) * TIMEOUT_S * 4))
    r = httpx.post(slow_server.url + "/v1/completions", timeout=60, json={
        "prompt": "tock", "max_tokens": tokens, "ignore_eos": True})
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "timeout"
    # the abandoned request does not keep the only seat
    ok = httpx.post(slow_server.url + "/v1/completions", timeout=60,
                    json={"prompt": "after", "max_tokens": 4})
    assert ok.status_code == 200

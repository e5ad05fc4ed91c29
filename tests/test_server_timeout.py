"""--request-timeout: the deadline is the request's, shared by its choices."""

from __future__ import annotations

import httpx
import pytest

from server_process import ServerProcess


@pytest.fixture(scope="module")
def slow_server(tiny_llama):
    # One seat: the choices of a request run one after another, so a deadline cuts the list.
    srv = ServerProcess("--model", tiny_llama, "--max-num-seqs", "1", "--max-model-len", "8192",
                        "--request-timeout", "2")
    yield srv
    assert srv.stop() == 0


def test_deadline_returns_the_choices_that_finished(slow_server):
    r = httpx.post(slow_server.url + "/v1/completions", timeout=60, json={
        "prompt": "tick", "n": 16, "max_tokens": 1000, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert 1 <= len(choices) < 16
    assert all(c["finish_reason"] == "length" for c in choices)
    assert r.json()["usage"]["completion_tokens"] == 1000 * len(choices)


def test_deadline_with_nothing_finished_is_504(slow_server):
    r = httpx.post(slow_server.url + "/v1/completions", timeout=60, json={
        "prompt": "tock", "max_tokens": 8000, "ignore_eos": True})
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "timeout"
    # the abandoned request does not keep the only seat
    ok = httpx.post(slow_server.url + "/v1/completions", timeout=60,
                    json={"prompt": "after", "max_tokens": 4})
    assert ok.status_code == 200

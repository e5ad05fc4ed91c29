"""--request-timeout: the deadline is the request's, shared by its choices."""

from __future__ import annotations

import httpx
import pytest

from machine_speed import seconds_per_token
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
    """Tokens per second of one sequence on this machine, now, at its fastest: the tests
    size their work from it, so a loaded CI machine cuts the list as surely as a quiet one.
    Its probes stay well inside the deadline, which a fixed 100-token probe did not."""
    return 1 / seconds_per_token(srv.url, probe_s=TIMEOUT_S / 4)


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
    # As long as the context allows: the longer, the surer nothing finishes (the deadline cuts
    # it anyway); the machine at its fastest would still take four deadlines for it.
    tokens = 32000
    assert decode_rate(slow_server) * TIMEOUT_S * 4 <= tokens, \
        "this machine decodes too fast for the test: raise --max-model-len and tokens"
    r = httpx.post(slow_server.url + "/v1/completions", timeout=60, json={
        "prompt": "tock", "max_tokens": tokens, "ignore_eos": True})
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "timeout"
    # the abandoned request does not keep the only seat
    ok = httpx.post(slow_server.url + "/v1/completions", timeout=60,
                    json={"prompt": "after", "max_tokens": 4})
    assert ok.status_code == 200

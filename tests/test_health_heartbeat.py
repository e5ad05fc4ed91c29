"""/health and /ready see a hung stage through heartbeats, and recover when it answers."""

from __future__ import annotations

import json
import threading
import time

import httpx
import psutil
import pytest
import zmq

from pocketllm.api.heartbeat import INTERVAL_S, STEP_SLACK, Heartbeat
from pocketllm.proto.messages import Pong
from server_process import ServerProcess

BOUND_S = 2.0


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess("--model", tiny_llama, "--max-model-len", "32768",
                        "--heartbeat-timeout", str(BOUND_S))
    yield srv
    assert srv.stop() == 0


def stage(srv: ServerProcess, module: str) -> psutil.Process:
    return next(p for p in psutil.Process(srv.proc.pid).children(recursive=True)
                if module in " ".join(p.cmdline()))


def wait_status(srv: ServerProcess, path: str, status: int, within: float) -> float:
    t0 = time.monotonic()
    while True:
        r = httpx.get(srv.url + path, timeout=5)
        if r.status_code == status:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within, f"{path} still {r.status_code}: {r.text}"
        time.sleep(0.1)


def test_stopped_worker_flips_health_and_recovers(server):
    assert httpx.get(server.url + "/health").status_code == 200
    worker = stage(server, "pocketllm.workers")
    worker.suspend()  # SIGSTOP: alive to the supervisor, deaf to everything
    try:
        # a ping waits at most INTERVAL_S to go out, then the bound
        wait_status(server, "/health", 503, BOUND_S + INTERVAL_S + 3)
        r = httpx.get(server.url + "/ready")
        assert r.status_code == 503
        body = r.json()
        assert body["status"] == "unresponsive" and "worker0" in body["stages"]
        assert "worker0" in body["message"]
        assert body["stages"]["worker0"] > BOUND_S
    finally:
        worker.resume()
    wait_status(server, "/health", 200, 5)
    assert httpx.get(server.url + "/ready").status_code == 200
    # and it still serves
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 200


def test_worker_stopped_mid_stream_flips_health_and_the_stream_goes_on(server):
    chunks: list = []

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
                "prompt": "go", "max_tokens": 600, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    while len(chunks) < 5:
        time.sleep(0.02)
    worker = stage(server, "pocketllm.workers")
    worker.suspend()  # a step is in flight: a stopped worker must not pass for a busy one
    try:
        wait_status(server, "/health", 503, BOUND_S + INTERVAL_S + 3)
        assert "worker0" in httpx.get(server.url + "/health").json()["stages"]
    finally:
        worker.resume()
    wait_status(server, "/health", 200, 5)
    t.join(120)
    assert chunks[-1] == "[DONE]"
    assert json.loads(chunks[-2])["choices"][0]["finish_reason"] == "length"


def test_stopped_tokenizer_flips_health(server):
    tokenizer = stage(server, "pocketllm.tokenizer")
    tokenizer.suspend()
    try:
        wait_status(server, "/health", 503, BOUND_S + INTERVAL_S + 3)
        assert list(httpx.get(server.url + "/health").json()["stages"]) == ["tokenizer"]
    finally:
        tokenizer.resume()
    wait_status(server, "/health", 200, 5)


# ---------------------------------------------------------------- the rule, without processes


@pytest.fixture
def beat(tmp_path):
    ctx = zmq.Context()
    names = ("scheduler", "worker0")
    hb = Heartbeat(ctx, {n: f"ipc://{tmp_path}/{n}.sock" for n in names}, timeout=0.3)
    pulls = {}
    for n in names:  # stand-in stages, so the pings have somewhere to go
        pulls[n] = ctx.socket(zmq.PULL)
        pulls[n].bind(f"ipc://{tmp_path}/{n}.sock")
    time.sleep(INTERVAL_S)  # the first pings go out one interval after the start
    hb.tick()
    time.sleep(0.5)  # and nobody answers them
    yield hb
    hb.close()
    for s in pulls.values():
        s.close(linger=0)
    ctx.term()


ANY = 10 ** 9  # a Pong answers every Ping up to its seq


def test_unanswered_ping_past_the_bound_is_unresponsive(beat):
    assert set(beat.unresponsive()) == {"scheduler", "worker0"}
    beat.on_pong(Pong("scheduler", ANY))
    assert set(beat.unresponsive()) == {"worker0"}
    beat.on_pong(Pong("worker0", ANY))
    assert beat.unresponsive() == {}


def test_worker_busy_with_a_usual_long_step_is_not_hung(beat):
    # a step in flight for 0.5 s, where steps of its size took 3 s lately: busy, not hung
    beat.on_pong(Pong("scheduler", ANY, step_age_s=0.5, step_expected_s=3.0))
    assert beat.unresponsive() == {}
    # the same step, where such steps took 0.01 s: the worker is stuck
    beat.on_pong(Pong("scheduler", ANY, step_age_s=0.5, step_expected_s=0.01))
    assert set(beat.unresponsive()) == {"worker0"}
    # past STEP_SLACK times the expected length even a slow step no longer excuses it
    beat.on_pong(Pong("scheduler", ANY, step_age_s=STEP_SLACK * 3.0 + 1, step_expected_s=3.0))
    assert set(beat.unresponsive()) == {"worker0"}
    # no step in flight: the plain bound
    beat.on_pong(Pong("scheduler", ANY))
    assert set(beat.unresponsive()) == {"worker0"}

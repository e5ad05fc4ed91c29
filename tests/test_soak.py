"""Load with random client disconnects: nothing leaks.

POCKETLLM_SOAK_REQUESTS requests (default 1,000; no new one after
POCKETLLM_SOAK_SECONDS, default 240, and at least 100 must run) from 8 concurrent
clients against the embedded default model: whole and streamed, chat and completions, a third of the
streams closed after their first chunk, and some clients that hang up right after
sending. Afterwards the /metrics gauges (running, waiting, KV blocks used) return to 0,
a request still gets its reference answer, and the resident memory of every process
(the HTTP server and each engine stage) is flat: the growth from the end of the warm-up
window (the first fifth of the requests) to the end is within RSS_TOLERANCE.

Run only this: `python -m pytest -q tests/test_soak.py` (POCKETLLM_SOAK_REQUESTS=5000
for a longer soak; the figures are printed with -s).
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import threading
import time

import httpx
import psutil
import pytest

from fuzz_checks import canary
from server_process import ServerProcess

REQUESTS = int(os.environ.get("POCKETLLM_SOAK_REQUESTS", "1000"))
# No new request after this many seconds: a slow or shared CPU runs fewer, and says so.
BUDGET_S = float(os.environ.get("POCKETLLM_SOAK_SECONDS", "240"))
MIN_REQUESTS = 100  # fewer would not separate a leak from allocator noise
CLIENTS = 8
GAUGES = ("pocketllm_requests_running", "pocketllm_requests_waiting",
          "pocketllm_kv_blocks_used")


def rss_tolerance(warm: int) -> int:
    """Allowed growth of one process after warm-up: allocator noise (glibc arenas, torch's
    caching allocator, Python's free lists) moves RSS by a few MiB either way."""
    return max(24 << 20, warm // 20)


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {g: float(re.search(rf"^{g}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M).group(1))
            for g in GAUGES}  # series carry a model_name label


def processes(srv: ServerProcess) -> dict[str, psutil.Process]:
    root = psutil.Process(srv.proc.pid)
    procs = {"http": root}
    for child in root.children(recursive=True):
        cmd = " ".join(child.cmdline())
        name = re.search(r"-m (pocketllm\.\w+)", cmd)
        procs[name.group(1) if name else f"pid{child.pid}"] = child
    return procs


def rss(procs: dict[str, psutil.Process]) -> dict[str, int]:
    return {name: p.memory_info().rss for name, p in procs.items()}


def one_request(url: str, port: int, rng: random.Random) -> str:
    """One request of a random kind; returns the kind (for the tally)."""
    chat = rng.random() < 0.4
    body: dict = {"max_tokens": rng.randint(1, 2), "temperature": rng.choice([0, 0.8])}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["Hi", "Count to 3",
                                                                    "Name a color"])}]
    else:
        body["prompt"] = rng.choice(["Hello", "Once upon a time", "1, 2, 3,"])
    path = "/v1/chat/completions" if chat else "/v1/completions"
    roll = rng.random()
    if roll < 0.1:  # hang up right after sending, while it is being served
        body["max_tokens"] = 32
        payload = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))
            time.sleep(rng.uniform(0, 0.3))
        return "hung up"
    if roll < 0.55:
        body["stream"] = True
        body["max_tokens"] = rng.randint(2, 6)
        cut = rng.random() < 0.33
        with httpx.stream("POST", url + path, json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if cut and line.startswith("data: "):
                    return "stream cut"  # closing the response hangs up mid-stream
        return "stream"
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return "whole"


@pytest.mark.slow
def test_soak_with_disconnects_leaks_nothing(default_model_path):
    srv = ServerProcess()  # no --model: the embedded default
    try:
        _soak(srv)
    finally:
        assert srv.stop() == 0


def _soak(srv: ServerProcess) -> None:
    canary(srv.url)
    reference = canary(srv.url)
    procs = processes(srv)
    lock = threading.Lock()
    state = {"next": 0, "done": 0, "errors": [], "kinds": {}}
    samples: list[tuple[int, dict[str, int]]] = []

    t0 = time.monotonic()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while True:
            with lock:
                if (state["next"] >= REQUESTS or state["errors"]
                        or time.monotonic() - t0 > BUDGET_S):
                    return
                state["next"] += 1
            try:
                kind = one_request(srv.url, srv.port, rng)
            except Exception as e:  # noqa: BLE001 - reported below with the count
                with lock:
                    state["errors"].append(repr(e)[:300])
                return
            with lock:
                state["done"] += 1
                state["kinds"][kind] = state["kinds"].get(kind, 0) + 1
                if state["done"] % 20 == 0:
                    samples.append((state["done"], rss(procs)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(1800)
    elapsed = time.monotonic() - t0
    done = state["done"]
    end = rss(procs)
    warm = next((r for n, r in samples if n >= done // 5), end)  # the warm-up window's end
    lines = [f"{done} of {REQUESTS} requests in {elapsed:.0f} s ({done / elapsed:.2f}/s) "
             f"{state['kinds']}"]
    grown = {}
    for name in procs:
        series = " ".join(f"{r[name] >> 20}" for _, r in samples)
        lines.append(f"  {name}: warm {warm[name] >> 20} MiB, end {end[name] >> 20} MiB "
                     f"(every 20 requests: {series})")
        if end[name] - warm[name] > rss_tolerance(warm[name]):
            grown[name] = (end[name] - warm[name]) >> 20
    print("\n".join(lines))  # the figures, also when a check below fails
    assert not state["errors"], state["errors"]
    assert done >= min(REQUESTS, MIN_REQUESTS), f"only {done} requests in {BUDGET_S:.0f} s"

    deadline = time.monotonic() + 30
    while any(gauges(srv.url).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gauges(srv.url) == {g: 0.0 for g in GAUGES}
    assert canary(srv.url) == reference
    assert not grown, f"resident memory grew (MiB): {grown}\n" + "\n".join(lines)

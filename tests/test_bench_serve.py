"""`pocketllm bench serve` against the real tiny server, and against a fake peer server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pocketllm.bench.serve import (ServeBenchConfig, inter_token_latencies, make_prompts,
                                   percentile, run_serve_bench, run_serve_bench_async)
from pocketllm.errors import InvalidRequestError
from server_process import ServerProcess, free_port

KEY = "bench-key"


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess("--model", tiny_llama, "--served-model-name", "tiny", "--api-key", KEY,
                        "--max-num-batched-tokens", "256", "--max-model-len", "512")
    yield srv
    assert srv.stop() == 0


def config(server, **kw) -> ServeBenchConfig:
    base = dict(url=server.url, api_key=KEY, num_requests=12, input_len=24, output_len=8,
                timeout=60.0)
    return ServeBenchConfig(**(base | kw))


def check_ordered(summary: dict) -> None:
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        st = summary[key]
        assert st["count"] > 0, key
        assert 0 <= st["p50"] <= st["p90"] <= st["p99"], (key, st)


def check_requests(result, n: int, output_len: int) -> None:
    s = result.summary()
    assert (s["completed"], s["failed"], result.errors) == (n, 0, {})
    assert result.ignore_eos_sent and result.notes == []
    assert s["total_output_tokens"] == n * output_len  # ignore_eos: every request runs out
    assert [r.index for r in result.records] == list(range(n))
    for r in result.records:
        assert r.ok and r.completion_tokens == output_len
        assert r.prompt_tokens and r.prompt_tokens > 0  # the server's own count
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert len(r.itl_s) == r.content_chunks - 1
    assert s["total_prompt_tokens"] == sum(r.prompt_tokens for r in result.records)
    assert s["request_throughput"] == pytest.approx(n / result.wall_s)
    assert s["output_throughput"] == pytest.approx(n * output_len / result.wall_s)
    assert s["total_token_throughput"] > s["output_throughput"]
    check_ordered(s)


def test_closed_loop_chat(server):
    result = run_serve_bench(config(server, concurrency=4), say=lambda s: None)
    assert result.model == "tiny"  # found through GET /v1/models
    check_requests(result, 12, 8)
    # Closed loop: never more than 4 requests in flight.
    spans = [(r.start_s, r.start_s + r.e2e_s) for r in result.records]
    for start, _ in spans:
        assert sum(a <= start < b for a, b in spans) <= 4


def test_open_loop_completions(server):
    cfg = config(server, endpoint="completions", request_rate=25.0, num_requests=10, seed=3)
    result = run_serve_bench(cfg, say=lambda s: None)
    check_requests(result, 10, 8)
    starts = [r.start_s for r in result.records]
    assert starts == sorted(starts) and starts[-1] > 0.05  # arrivals spread out, in order


def test_wrong_api_key_counts_errors(server):
    said: list[str] = []
    result = run_serve_bench(config(server, api_key="wrong", concurrency=3), say=said.append)
    s = result.summary()
    assert (s["completed"], s["failed"]) == (0, 12)
    assert s["total_output_tokens"] == 0 and s["ttft_s"]["p50"] is None
    (msg, count), = result.errors.items()
    assert count == 12 and msg.startswith("HTTP 401") and "API key" in msg
    assert sum(line.startswith("error") for line in said) == 1  # printed once
    assert "failed" in result.table()


def test_unreachable_server_counts_errors():
    cfg = ServeBenchConfig(url=f"http://127.0.0.1:{free_port()}", num_requests=5,
                           concurrency=2, timeout=10)
    result = run_serve_bench(cfg, say=lambda s: None)
    assert result.summary()["failed"] == 5 and sum(result.errors.values()) == 5


def test_cli_smoke(server, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pocketllm", "bench", "serve", "--url", server.url + "/v1",
         "--api-key", KEY, "--num-requests", "3", "--concurrency", "2", "--input-len", "16",
         "--output-len", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()
    assert last[0].startswith("endpoint") and last[-1].startswith("E2E")  # the table is last
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == 3 and data["summary"]["total_output_tokens"] == 12
    assert data["config"]["api_key"] is True  # never the key itself
    assert len(data["requests"]) == 3 and data["requests"][0]["ttft_s"] > 0


def test_cli_refuses_both_loops():
    proc = subprocess.run([sys.executable, "-m", "pocketllm", "bench", "serve",
                           "--concurrency", "2", "--request-rate", "3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not allowed with" in proc.stderr


# ---------------------------------------------------------------- without a server


def test_config_validation():
    for bad in (dict(concurrency=0), dict(request_rate=0.0), dict(num_requests=0),
                dict(endpoint="embeddings"), dict(concurrency=2, request_rate=1.0),
                dict(timeout=0), dict(url="localhost:8000")):
        with pytest.raises(InvalidRequestError):
            ServeBenchConfig(**bad).validate()


def test_prompts_are_deterministic_and_distinct():
    a = make_prompts(20, 50, seed=7)
    assert a == make_prompts(20, 50, seed=7) and a != make_prompts(20, 50, seed=8)
    assert len(set(a)) == 20 and all(len(p.split()) == 50 for p in a)


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 90) == 90.0


def test_inter_token_latencies():
    times = [1.0, 1.2, 1.6, 1.7]
    # Per-chunk counts from the server: each gap over the tokens of the chunk it ends.
    assert inter_token_latencies(times, [1, 2, 4, 1], 8) == pytest.approx([0.1, 0.1, 0.1])
    # Unknown counts: 8 tokens in 4 chunks are taken as 2 per chunk.
    assert inter_token_latencies(times, [None] * 4, 8) == pytest.approx([0.1, 0.2, 0.05])
    # One token a chunk (or fewer tokens than chunks): the gaps themselves.
    assert inter_token_latencies(times, [None] * 4, 3) == pytest.approx([0.2, 0.4, 0.1])
    assert inter_token_latencies([1.0], [1], 1) == [] and inter_token_latencies([], [], 0) == []


# ---------------------------------------------------------------- a fake peer server


def fake_peer() -> web.Application:
    """Refuses ignore_eos like a peer server; chat streams 4 tokens in 3 content chunks
    (the middle one holds 2) with per-chunk usage; completions fails mid-stream."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if "ignore_eos" in body:
            return web.json_response({"error": {"message": "unknown field ignore_eos"}},
                                     status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(data) -> None:
            await resp.write(f"data: {json.dumps(data)}\n\n".encode())

        def chunk(delta, tokens, finish=None):
            return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": tokens}}

        await send(chunk({"role": "assistant", "content": ""}, 0))
        await send(chunk({"content": "a"}, 1))
        await asyncio.sleep(0.1)
        await send(chunk({"content": "bc"}, 3))
        await asyncio.sleep(0.1)
        await send(chunk({"content": "d"}, 4))
        await send(chunk({}, 4, "length"))
        await send({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4,
                                             "prompt_tokens_details": {"cached_tokens": 2}}})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n')
        await resp.write(b'data: {"error": {"message": "the engine fell over"}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    return app


async def test_peer_without_ignore_eos_and_multi_token_chunks():
    async with TestServer(fake_peer(), port=free_port()) as srv:
        cfg = ServeBenchConfig(url=str(srv.make_url("/")), num_requests=6, concurrency=3,
                               output_len=4, model="peer")
        said: list[str] = []
        result = await run_serve_bench_async(cfg, say=said.append)
    s = result.summary()
    assert (s["completed"], s["failed"]) == (6, 0)
    assert not result.ignore_eos_sent and "ignore_eos" in result.notes[0]
    assert sum("ignore_eos" in line for line in said) == 1  # noted once despite the race
    assert s["total_output_tokens"] == 24 and s["total_prompt_tokens"] == 30
    assert s["total_cached_prompt_tokens"] == 12
    for r in result.records:
        assert r.content_chunks == 3 and len(r.itl_s) == 2
        first, second = r.itl_s  # gaps of >= 0.1 s; the first after "a" held 2 tokens
        assert first >= 0.045 and second >= 0.095, result.records  # (stalls only add)


async def test_error_event_mid_stream_is_counted():
    async with TestServer(fake_peer(), port=free_port()) as srv:
        cfg = ServeBenchConfig(url=str(srv.make_url("/")), endpoint="completions",
                               num_requests=4, concurrency=2, model="peer")
        result = await run_serve_bench_async(cfg, say=lambda s: None)
    assert result.summary()["failed"] == 4
    assert list(result.errors) == ["error event in the stream: the engine fell over"]

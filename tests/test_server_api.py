"""The real server as a subprocess, driven by openai, langchain-openai and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from server_process import ServerProcess

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess("--model", tiny_llama, "--served-model-name", "tiny",
                        "--max-num-batched-tokens", "256", "--max-model-len", "512")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


GREEDY = {"temperature": 0, "max_tokens": 16}
MSG = [{"role": "user", "content": "Tell me about the sea."}]


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


# ---------------------------------------------------------------- happy paths


def test_ready_was_503_while_loading(server):
    assert server.first_ready_status == 503
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/alive").status_code == 200


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_and_completion(client):
    chat = client.chat.completions.create(model="anything", messages=MSG, **GREEDY)
    assert chat.model == "tiny" and chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens >= 1
    comp = client.completions.create(model="tiny", prompt="Once upon a time", **GREEDY)
    assert comp.object == "text_completion" and comp.choices[0].text
    assert comp.usage.prompt_tokens > 0


def test_streaming_equals_whole(client):
    whole = client.chat.completions.create(model="tiny", messages=MSG, **GREEDY)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MSG, stream=True, stream_options={"include_usage": True},
        **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    no_usage = list(client.completions.create(model="tiny", prompt="abc", stream=True, **GREEDY))
    assert all(c.usage is None for c in no_usage)


def test_n3_streamed_interleaved(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MSG, n=3, stream=True, temperature=1.0, seed=7, max_tokens=12))
    order = [c.choices[0].index for c in chunks if c.choices]
    assert set(order) == {0, 1, 2}
    first_done = min(i for i, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason)
    assert len({c.choices[0].index for c in chunks[:first_done]}) == 3  # interleaved
    whole = client.chat.completions.create(model="tiny", messages=MSG, n=3, **GREEDY)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    single = client.chat.completions.create(model="tiny", messages=MSG, **GREEDY)
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens
    assert whole.usage.completion_tokens == 3 * single.usage.completion_tokens


def test_stop_spanning_tokens(client):
    base = client.completions.create(model="tiny", prompt="The sea is", max_tokens=24,
                                     temperature=0).choices[0].text
    stop = base[4:10]
    whole = client.completions.create(model="tiny", prompt="The sea is", max_tokens=24,
                                      temperature=0, stop=[stop])
    assert whole.choices[0].text == base[:base.index(stop)]
    assert whole.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="The sea is", max_tokens=24, temperature=0, stop=stop,
        stream=True))
    assert streamed == whole.choices[0].text


def test_logprobs_bytes_concatenate(client):
    chat = client.chat.completions.create(model="tiny", messages=MSG, logprobs=True,
                                          top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    answer = chat.choices[0].message.content
    # (the random model writes invalid UTF-8 too, which the text shows as U+FFFD)
    assert bytes(b for t in content for b in t.bytes).decode("utf-8", "replace") == answer
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy: argmax first
    comp = client.completions.create(model="tiny", prompt="Hi", logprobs=2, **GREEDY)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.top_logprobs[0]) == 2


def test_langchain(server):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="tiny", temperature=0,
                        max_tokens=12)
    msg = llm.invoke("Hello there")
    streamed = "".join(chunk.content for chunk in llm.stream("Hello there"))
    assert msg.content == streamed


# ---------------------------------------------------------------- field contract

REFUSED_CHAT = [
    ("stop", 5), ("logprobs", 3), ("top_logprobs", 50), ("frequency_penalty", 2.5),
    ("presence_penalty", -3), ("presence_penalty", "1"), ("repetition_penalty", 0),
    ("logit_bias", {"abc": 5}), ("logit_bias", {"1": 101}), ("logit_bias", [1]),
    ("logit_bias", {str(i): 1 for i in range(301)}), ("tool_choice", "required"),
    ("parallel_tool_calls", "no"), ("response_format", {"type": "yaml"}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("n", 129), ("n", 0),
    ("n", 1.5), ("temperature", "hot"), ("max_tokens", 0), ("top_p", 0), ("unknown_field", 1),
    ("drop_thinking", True),
]


@pytest.mark.parametrize("field, value", REFUSED_CHAT)
def test_refused_chat_field(server, field, value):
    r = post(server, "/v1/chat/completions", {"messages": MSG, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field and err["message"]


def test_top_logprobs_needs_logprobs(server):
    r = post(server, "/v1/chat/completions", {"messages": MSG, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


REFUSED_COMPLETION = [
    ("logprobs", True), ("logprobs", 21), ("top_logprobs", 2), ("echo", "yes"),
    ("suffix", "end"), ("best_of", 0), ("best_of", 129), ("stop", [1, 2]), ("logit_bias", {"-5": 1}),
    ("logit_bias", {"5": "x"}), ("frequency_penalty", -2.5), ("repetition_penalty", -1),
]


@pytest.mark.parametrize("field, value", REFUSED_COMPLETION)
def test_refused_completion_field(server, field, value):
    r = post(server, "/v1/completions", {"prompt": "hi", field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("field, value", [
    ("logprobs", False), ("frequency_penalty", 0), ("presence_penalty", 0.0), ("logit_bias", {}),
    ("frequency_penalty", 0.5), ("presence_penalty", -1), ("repetition_penalty", 1.2),
    ("logit_bias", {"1": 5, "300": -100}),
    ("stop", []), ("stop", ["", "x"]), ("tool_choice", "auto"), ("parallel_tool_calls", True),
    ("parallel_tool_calls", False), ("tool_choice", "none"),
    ("response_format", {"type": "text"}), ("user", "u1"), ("store", False),
    ("metadata", {"a": "b"}), ("service_tier", "auto"), ("model", "something-else"),
    ("max_completion_tokens", 3), ("seed", 1), ("top_k", 5),
])
def test_accepted_defaults_and_inert_fields(server, field, value):
    r = post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 4, field: value})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny"


def test_penalties_and_bias_act(server):
    def tokens(**kw):
        r = post(server, "/v1/completions", {"prompt": "The sea is", "temperature": 0,
                                             "max_tokens": 12, "ignore_eos": True, "logprobs": 1,
                                             **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]

    def distinct(lp):  # a token's bytes name it (its text may be a lone "\ufffd")
        return len({tuple(t["bytes"]) for t in lp["content"]})

    assert distinct(tokens()) < 12  # the tiny model repeats itself...
    assert distinct(tokens(presence_penalty=2.0)) == 12  # ...unless penalised
    forced = tokens(logit_bias={"300": 100})
    assert distinct(forced) == 1
    # logprobs rank the model's own distribution: the forced token is not its top choice
    assert forced["token_logprobs"][0] < max(forced["top_logprobs"][0].values())


def test_logit_bias_outside_vocabulary(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "logit_bias": {"100000": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_max_completion_tokens_wins(server):
    r = post(server, "/v1/chat/completions", {"messages": MSG, "temperature": 0, "ignore_eos": True,
                                               "max_tokens": 9, "max_completion_tokens": 3})
    assert r.json()["usage"]["completion_tokens"] == 3


def test_caller_messages_not_mutated_and_text_parts(server):
    parts = [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "about the sea."}]
    r = post(server, "/v1/chat/completions",
             {"messages": [{"role": "user", "content": parts}], **GREEDY})
    assert r.status_code == 200
    r = post(server, "/v1/chat/completions",
             {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert r.status_code == 400


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("raw, status", [
    (b"{not json", 400), (b"\xff\xfe{}", 400), (b"[1, 2]", 400),
    (json.dumps({"messages": []}).encode(), 400),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400),
    (json.dumps({"messages": "hello"}).encode(), 400),
    (json.dumps({"messages": MSG, "n": 100000}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "word " * 4000}]}).encode(), 400),
    (b'{"messages": [{"role": "user", "content": "' + b"x" * (9 << 20) + b'"}]}', 413),
], ids=["malformed", "utf8", "not-object", "empty-messages", "bad-role", "messages-string",
        "huge-n", "too-long", "over-size"])
def test_bad_input_is_refused_and_costs_nothing(server, raw, status):
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert "error" in r.json() and r.json()["error"]["message"]
    ok = post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2})
    assert ok.status_code == 200


def test_404s_in_openai_shape(server):
    for method, path in [("GET", "/v1/embeddings"), ("POST", "/v1/embeddings"),
                         ("GET", "/nothing"), ("DELETE", "/v1/requests/unknown-id")]:
        r = httpx.request(method, server.url + path)
        assert r.status_code == 404, (method, path)
        assert r.json()["error"]["message"]


# ---------------------------------------------------------------- concurrency, cancellation


def test_32_concurrent_streams_match_alone(server):
    prompts = [f"Story number {i}: once" for i in range(32)]

    async def one(http, prompt):
        text = ""
        async with http.stream("POST", server.url + "/v1/completions", json={
                "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            alone = [await one(http, p) for p in prompts[:8]]
            together = await asyncio.gather(*(one(http, p) for p in prompts))
            return alone, together

    alone, together = asyncio.run(run())
    assert together[:8] == alone


def test_delete_cancels_all_choices(server):
    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", server.url + "/v1/completions", json={
                    "prompt": "go on", "max_tokens": 400, "ignore_eos": True, "n": 2,
                    "stream": True, "request_id": "del-me"}) as r:
                finishes, deleted = [], False
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    if choice["finish_reason"]:
                        finishes.append(choice["finish_reason"])
                    elif not deleted:
                        deleted = True
                        d = await http.delete(server.url + "/v1/requests/del-me")
                        assert d.status_code == 200
                return finishes

    finishes = asyncio.run(run())
    assert finishes == ["abort", "abort"]
    assert httpx.delete(server.url + "/v1/requests/del-me").status_code == 404


def test_metrics_counters(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": "count the steps", "max_tokens": 3})
    assert r.status_code == 200
    deadline = time.monotonic() + 10  # the scheduler's idle stats follow its last step
    while True:
        text = httpx.get(server.url + "/metrics").text
        if 'pocketllm_steps_total{model_name="tiny",path="eager"} 0.0' not in text or \
                time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for name in ("pocketllm_requests_total", "pocketllm_prompt_tokens_total",
                 "pocketllm_generation_tokens_total", "pocketllm_time_to_first_token_seconds",
                 "pocketllm_inter_token_latency_seconds", "pocketllm_e2e_request_latency_seconds",
                 "pocketllm_kv_blocks_total", "pocketllm_prefix_cache_hits_tokens_total",
                 "pocketllm_preemptions_total", "pocketllm_overlapped_steps_total"):
        assert name in text, name
    # the scheduler's cumulative figures are counters, and every series names the model
    for name in ("preemptions", "prefix_cache_hits_tokens", "steps", "step_launch_seconds"):
        assert f"# TYPE pocketllm_{name}_total counter" in text, name
    samples = [line for line in text.splitlines() if line.startswith("pocketllm_")]
    assert samples and all('model_name="tiny"' in line for line in samples)
    # on the CPU every step is eager
    assert 'pocketllm_steps_total{model_name="tiny",path="graph"} 0.0' in text
    assert 'pocketllm_steps_total{model_name="tiny",path="piecewise"} 0.0' in text
    eager = [line for line in samples
             if line.startswith('pocketllm_steps_total{model_name="tiny",path="eager"}')]
    assert len(eager) == 1 and float(eager[0].split()[-1]) > 0
    # no device span on a CPU
    assert 'pocketllm_step_device_seconds_total{model_name="tiny",path="eager"} 0.0' in text
    launch = [line for line in samples
              if line.startswith('pocketllm_step_launch_seconds_total{model_name="tiny",path="eager"}')]
    assert len(launch) == 1 and float(launch[0].split()[-1]) > 0


def test_auth(tiny_llama):
    srv = ServerProcess("--model", tiny_llama, "--api-key", "s3cret")
    try:
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/v1/models",
                         headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200  # probes stay open
    finally:
        assert srv.stop() == 0

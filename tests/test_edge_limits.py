"""Every value checked once at the edge (protocol/limits.py), every HTTP error OpenAI-shaped.

Unit tests of the validators (no engine), the HTTP error shapes on an app without an
engine (raw sockets against aiohttp's parser), and one real server on the embedded
default model that gets each hostile example of issue 18 and keeps serving.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
import threading

import httpx
import pytest

from pocketllm.api.requests import chat_request, prompt_request
from pocketllm.errors import InvalidRequestError, PromptTooLongError
from pocketllm.protocol import limits as L
from pocketllm.protocol.limits import DEFAULT_LIMITS, RequestLimits, parse_body
from pocketllm.protocol.openai_fields import parse_chat, parse_completion
from pocketllm.sampling import SamplingParams

MSG = [{"role": "user", "content": "hi"}]
BIG = 1 << 64  # beyond every 64-bit range
MODEL = RequestLimits().for_model(vocab_size=100, max_model_len=512)


def chat(limits=DEFAULT_LIMITS, **fields):
    return parse_chat({"messages": MSG, **fields}, "rid", limits)


def completion(limits=DEFAULT_LIMITS, **fields):
    return parse_completion({"prompt": "hi", **fields}, "rid", limits)


def refused(fn, *args, param=None, error=InvalidRequestError, **kw) -> InvalidRequestError:
    with pytest.raises(error) as info:
        fn(*args, **kw)
    if param is not None:
        assert info.value.param == param, info.value
    return info.value


# ---------------------------------------------------------------- integers


@pytest.mark.parametrize("endpoint, field, value", [
    (chat, "max_tokens", BIG), (chat, "max_completion_tokens", BIG), (chat, "top_k", BIG),
    (chat, "seed", BIG), (chat, "seed", -BIG), (chat, "n", BIG), (chat, "top_logprobs", BIG),
    (chat, "stop_token_ids", [BIG]), (chat, "logit_bias", {str(BIG): 1}),
    (chat, "logit_bias", {"1" * 5000: 1}), (completion, "max_tokens", BIG),
    (completion, "best_of", BIG), (completion, "logprobs", BIG), (completion, "prompt", [BIG]),
    (completion, "prompt", [[1, 2], [BIG]]), (completion, "seed", BIG),
    (completion, "top_k", BIG), (completion, "stop_token_ids", [1, BIG]),
])
def test_integers_beyond_64_bits_are_refused_naming_the_field(endpoint, field, value):
    refused(endpoint, **{field: value}, param=field)


def test_64_bit_bounds_are_inclusive_and_bool_is_not_an_int():
    chat(seed=L.INT64_MAX, top_k=L.INT64_MAX, max_tokens=L.INT64_MAX)
    chat(seed=L.INT64_MIN)
    refused(chat, seed=L.INT64_MAX + 1, param="seed")
    for field in ("max_tokens", "top_k", "seed", "n"):
        refused(chat, **{field: True}, param=field)
    refused(chat, stop_token_ids=[True], param="stop_token_ids")


def test_the_models_bounds_are_enforced_once_known():
    chat(MODEL, stop_token_ids=[99], logit_bias={"99": 5}, max_tokens=512)
    refused(chat, MODEL, stop_token_ids=[100], param="stop_token_ids")
    refused(chat, MODEL, logit_bias={"100": 1}, param="logit_bias")
    refused(chat, MODEL, max_tokens=513, param="max_tokens")
    refused(chat, MODEL, max_completion_tokens=10 ** 6, param="max_completion_tokens")
    refused(completion, MODEL, prompt=[5, 100], param="prompt")
    refused(completion, MODEL, prompt=[5] * 512, param="prompt", error=PromptTooLongError)
    # stop_token_ids outside the vocabulary with a grammar killed the scheduler
    refused(chat, MODEL, stop_token_ids=[10 ** 6], response_format={"type": "json_object"},
            param="stop_token_ids")


# ---------------------------------------------------------------- the body


def test_lone_surrogates_anywhere_are_refused_naming_the_field():
    def body(obj):
        return json.dumps(obj).encode()  # ensure_ascii: "\ud800" travels as an escape

    for field, value in [("messages", [{"role": "user", "content": "a\ud800"}]),
                         ("stop", ["\udfff"]), ("tools", [{"function": {"name": "\ud801"}}]),
                         ("response_format", {"type": "regex", "regex": "\udc00"}),
                         ("chat_template_kwargs", {"x": ["\ud800"]})]:
        refused(parse_body, body({field: value}), DEFAULT_LIMITS, param=field)
    refused(parse_body, b'{"\\ud800": 1}', DEFAULT_LIMITS)  # a key
    refused(parse_body, b'{"metadata": {"\\udbff": 1}}', DEFAULT_LIMITS, param="metadata")
    ok = parse_body(body({"messages": [{"role": "user", "content": "\U0001F600"}]}),
                    DEFAULT_LIMITS)  # a pair is one character
    assert ok["messages"][0]["content"] == "\U0001F600"


def test_json_depth_is_bounded_without_recursion():
    deep = b"[" * 10_000 + b"]" * 10_000
    refused(parse_body, b'{"a": ' + deep + b"}", DEFAULT_LIMITS)
    refused(parse_body, b'{"a": ' + b"[" * 900 + b"]" * 900 + b"}", DEFAULT_LIMITS, param="a")
    at = b'{"a": ' + b"[" * 63 + b"]" * 63 + b"}"  # the body object is level 1
    assert parse_body(at, DEFAULT_LIMITS)
    refused(parse_body, b'{"a": ' + b"[" * 64 + b"]" * 64 + b"}", DEFAULT_LIMITS, param="a")
    assert parse_body(b'{"a": [[[[1]]]]}', RequestLimits(max_json_depth=5))
    refused(parse_body, b'{"a": [[[[1]]]]}', RequestLimits(max_json_depth=4))


@pytest.mark.parametrize("raw", [b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -1e400}',
                                 b"\xff{}", b"[1]", b'{"a": 1' + b"0" * 5000 + b"}"])
def test_non_json_values_are_refused(raw):
    refused(parse_body, raw, DEFAULT_LIMITS)


# ---------------------------------------------------------------- strings and counts


def test_stop_strings_are_bounded():
    refused(chat, stop="x" * (1 << 20), param="stop")  # 1 MB killed the detokenizer
    refused(chat, stop=["s%d" % i for i in range(33)], param="stop")
    refused(chat, stop=["é" * 600] * 4, param="stop")  # 4800 bytes together
    chat(stop=["s%d" % i for i in range(32)])
    wide = RequestLimits(max_stop_strings=100, max_stop_bytes=1 << 16)
    chat(wide, stop=["s%d" % i for i in range(100)])
    sp = SamplingParams(stop=["s%d" % i for i in range(50)])  # construction: fixed limits only
    refused(sp.validate, param="stop")
    sp.validate(wide)
    refused(SamplingParams, stop="x" * (L.MAX_STOP_STRING_CHARS + 1), param="stop")


def test_counts_and_sizes():
    refused(chat, logit_bias={str(i): 1 for i in range(301)}, param="logit_bias")
    refused(chat, stop_token_ids=list(range(L.MAX_STOP_TOKEN_IDS + 1)), param="stop_token_ids")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    refused(chat, tools=[tool] * (L.MAX_TOOLS + 1), param="tools")
    big = {"type": "function", "function": {"name": "f", "description": "d" * (130 << 10)}}
    refused(chat, tools=[big], param="tools")
    refused(parse_chat, {"messages": MSG * (L.MAX_MESSAGES + 1)}, "rid", param="messages")
    small = RequestLimits(max_prompt_chars=10)
    refused(parse_chat, {"messages": [{"role": "user", "content": "x" * 11}]}, "rid", small,
            param="messages", error=PromptTooLongError)
    refused(completion, small, prompt=["x" * 6, "y" * 5], param="prompt", error=PromptTooLongError)
    refused(completion, prompt=["p"] * 129, param="prompt")
    completion(small, prompt="x" * 10)


def test_response_format_size_and_depth():
    schema = {"type": "string"}
    for _ in range(450):  # 900 levels stalled the tokenizer for 40 s
        schema = {"type": "object", "properties": {"a": schema}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    refused(chat, response_format=fmt, param="response_format")
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}
    refused(chat, response_format={"type": "json_schema", "json_schema": {"schema": wide}},
            param="response_format")
    refused(chat, response_format={"type": "regex", "regex": "a" * (65 << 10)},
            param="response_format")
    refused(SamplingParams, response_format=fmt, param="response_format")  # offline too
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "array", "items": {"type": "integer"}}}}}}
    chat(response_format={"type": "json_schema", "json_schema": {"schema": nested}})


def test_chat_template_kwargs_cannot_override_the_engines_variables():
    for key in ("bos_token", "eos_token", "pad_token", "messages", "add_generation_prompt",
                "tools", "tool_choice", "drop_thinking", "raise_exception", "namespace",
                "not an identifier", "x" * 65):
        refused(chat, chat_template_kwargs={key: "x"}, param="chat_template_kwargs")
    refused(chat, chat_template_kwargs={"v": [[[[["deep"]]]]]}, param="chat_template_kwargs")
    refused(chat, chat_template_kwargs={"v": "x" * (17 << 10)}, param="chat_template_kwargs")
    refused(chat, chat_template_kwargs={f"k{i}": 1 for i in range(33)},
            param="chat_template_kwargs")
    parsed = chat(chat_template_kwargs={"enable_thinking": False, "documents": [{"t": "x"}]})
    assert parsed.choices[0].chat_options["enable_thinking"] is False


def test_reserved_names_cover_what_the_renderer_passes():
    from jinja2.defaults import DEFAULT_NAMESPACE

    from pocketllm.protocol.chat import ChatRenderer, _builtin, _compile

    passed = set(inspect.signature(ChatRenderer.render).parameters) - {"self",
                                                                        "template_kwargs"}
    env_globals = set(_compile(_builtin("gemma.jinja")).environment.globals)
    assert passed | set(DEFAULT_NAMESPACE) | env_globals <= L.RESERVED_TEMPLATE_KWARGS
    # the special tokens (bos_token, eos_token, ...) are refused by their suffix


def test_request_ids():
    for rid in ("x" * 201, "a b", "a/b", "a\r\nb", "", 5):
        refused(L.check_request_id, rid, param="request_id")
    assert L.check_request_id("chatcmpl-1.2:3@x+y=z~") == "chatcmpl-1.2:3@x+y=z~"


def test_the_library_enforces_the_same_limits():
    sp = SamplingParams(max_tokens=8)
    refused(prompt_request, [1, 100], sp, limits=MODEL, param="prompt")
    refused(prompt_request, "a\ud800", sp, param="prompt")
    refused(prompt_request, "x" * 11, sp, limits=RequestLimits(max_prompt_chars=10),
            error=PromptTooLongError)
    refused(prompt_request, "hi", SamplingParams(max_tokens=513), limits=MODEL,
            param="max_tokens")
    refused(prompt_request, "hi", sp, "a b", param="request_id")
    refused(chat_request, MSG, sp, chat_template_kwargs={"bos_token": "x"},
            param="chat_template_kwargs")
    refused(chat_request, [{"role": "user", "content": "\udc00"}], sp, param="messages")
    deep: list = []
    for _ in range(100):
        deep = [deep]
    refused(chat_request, MSG, sp, chat_template_kwargs={"v": deep},
            param="chat_template_kwargs")
    refused(chat_request, MSG, SamplingParams(stop_token_ids=[100]), limits=MODEL,
            param="stop_token_ids")
    assert chat_request(MSG, sp, limits=MODEL).messages[0]["content"] == "hi"
    refused(SamplingParams, seed=10 ** 5000, param="seed")  # str() of it would raise


def test_the_configurable_limits_come_from_engine_args_and_flags():
    from pocketllm.cli import build_parser, engine_args_from
    from pocketllm.config import EngineArgs

    ns = build_parser().parse_args(["serve", "--max-stop-strings", "5", "--max-stop-bytes", "9",
                                    "--max-prompt-chars", "7", "--max-json-depth", "3"])
    limits = RequestLimits.from_args(engine_args_from(ns))
    assert (limits.max_stop_strings, limits.max_stop_bytes, limits.max_prompt_chars,
            limits.max_json_depth) == (5, 9, 7, 3)
    assert RequestLimits.from_args(EngineArgs()) == DEFAULT_LIMITS
    refused(EngineArgs, max_json_depth=0, param="max_json_depth")


# ---------------------------------------------------------------- HTTP errors (no engine)


def raw_http(port: int, data: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, json.loads(body)


def assert_openai_error(status: int, body: dict, expected: int) -> None:
    assert status == expected, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], body
    assert err["type"] == ("server_error" if expected >= 500 else "invalid_request_error")


@pytest.fixture(scope="module")
def bare_app():
    """The HTTP surface without an engine (every generation request is refused 503 after
    parsing): aiohttp's own errors are the point here."""
    from pocketllm.server.app import ServerState, build_app
    from pocketllm.server.http_errors import OpenAIAppRunner

    loop = asyncio.new_event_loop()
    started = threading.Event()
    box = {}

    async def main():
        runner = OpenAIAppRunner(build_app(ServerState("m"), max_body_bytes=1 << 16),
                                 access_log=None)
        await runner.setup()
        site = __import__("aiohttp").web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["port"] = site._server.sockets[0].getsockname()[1]
        box["stop"] = asyncio.Event()
        started.set()
        await box["stop"].wait()
        await runner.cleanup()

    t = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    t.start()
    assert started.wait(30)
    yield f"http://127.0.0.1:{box['port']}", box["port"]
    loop.call_soon_threadsafe(box["stop"].set)
    t.join(10)


RAW_CASES = {
    "bad-method": (b"GARBAGE\r\n\r\n", 400),
    "tls-on-http": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),
    "bad-version": (b"POST /v1/completions HTTP/9.9\r\nHost: x\r\n\r\n", 400),
    "long-url": (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
    "long-header": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: " +
                    b"a" * 10_000 + b"\r\n\r\n", 431),
    "many-headers": (b"GET /health HTTP/1.1\r\nHost: x\r\n" +
                     b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n", 431),
    "bad-header": (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400),
    "bad-length": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n",
                   400),
    "bad-chunk": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                  b"\r\n\r\nzz\r\n", 400),
}


@pytest.mark.parametrize("case", RAW_CASES)
def test_parser_errors_are_openai_shaped(bare_app, case):
    data, expected = RAW_CASES[case]
    assert_openai_error(*raw_http(bare_app[1], data), expected)


def test_routing_and_body_errors_are_openai_shaped(bare_app):
    url, _ = bare_app
    cases = [
        ("GET", "/v1/embeddings", {}, None, 404),
        ("PUT", "/v1/chat/completions", {}, b"{}", 405),
        ("POST", "/v1/completions", {"Content-Type": "application/json"},
         b'{"prompt": "' + b"x" * (70 << 10) + b'"}', 413),
        ("POST", "/v1/completions", {"Content-Type": "application/xml"}, b"<a/>", 415),
        ("POST", "/v1/completions", {"Content-Type": "application/json; charset=latin-1"},
         b"{}", 415),
        ("POST", "/v1/completions", {"Content-Type": "application/json",
                                     "Content-Encoding": "gzip"}, b"not gzip", 400),
        ("POST", "/v1/completions", {"X-Request-Id": "a\tb"}, b'{"prompt": "x"}', 400),
        ("POST", "/v1/completions", {"X-Request-Id": "x" * 5000}, b'{"prompt": "x"}', 400),
        ("POST", "/v1/completions", {}, b'{"prompt": "x", "seed": 18446744073709551616}', 400),
    ]
    for method, path, headers, body, expected in cases:
        r = httpx.request(method, url + path, headers=headers, content=body, timeout=30)
        assert_openai_error(r.status_code, r.json(), expected)
    r = httpx.put(url + "/v1/chat/completions", content=b"{}")
    assert "POST" in r.headers["Allow"]
    # curl -d sends form-urlencoded: read as JSON, refused only for the missing engine
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "x"}',
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "loading"


# ---------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server(default_model_path):
    from server_process import ServerProcess

    srv = ServerProcess()  # the embedded Gemma 3 270M
    yield srv
    assert srv.stop() == 0


def _surrogate_body(field_json: str) -> bytes:
    return ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
            + field_json + "}").encode()


def _chat(**fields) -> bytes:
    return json.dumps({"messages": MSG, "max_tokens": 2, **fields}).encode()


def _completion(**fields) -> bytes:
    return json.dumps({"prompt": "hi", "max_tokens": 2, **fields}).encode()


HOSTILE = {  # each killed a stage or got a bare 500 before (issue 18)
    **{f"chat-{f}": ("/v1/chat/completions", _chat(**{f: BIG}))
       for f in ("max_tokens", "top_k", "seed", "n", "top_logprobs")},
    **{f"completion-{f}": ("/v1/completions", _completion(**{f: BIG}))
       for f in ("max_tokens", "top_k", "seed", "best_of", "logprobs")},
    "stop_token_ids-64bit": ("/v1/chat/completions", _chat(stop_token_ids=[BIG])),
    "logit_bias-key-64bit": ("/v1/chat/completions", _chat(logit_bias={str(BIG): 1})),
    "prompt-ids-64bit": ("/v1/completions", _completion(prompt=[1, BIG])),
    "max_tokens-1e6": ("/v1/completions", _completion(max_tokens=10 ** 6)),
    "surrogate-content": ("/v1/chat/completions",
                          b'{"messages": [{"role": "user", "content": "a\\ud800"}]}'),
    "surrogate-stop": ("/v1/chat/completions", _surrogate_body('"stop": ["\\udc00"]')),
    "deep-json": ("/v1/chat/completions",
                  _surrogate_body('"metadata": ' + "[" * 10_000 + "]" * 10_000)),
    "stop-1MB": ("/v1/chat/completions", _chat(stop="x" * (1 << 20))),
    "kwargs-bos_token": ("/v1/chat/completions", _chat(chat_template_kwargs={"bos_token": "x"})),
    "kwargs-messages": ("/v1/chat/completions", _chat(chat_template_kwargs={"messages": []})),
    "stop_token_ids-vocab-json": ("/v1/chat/completions", _chat(
        stop_token_ids=[10 ** 9], response_format={"type": "json_object"})),
    "stop_token_ids-64bit-json": ("/v1/chat/completions", _chat(
        stop_token_ids=[BIG], response_format={"type": "json_object"})),
    "deep-schema": ("/v1/chat/completions", _chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(
            '{"type": "object", "properties": {"a": ' * 30 + '{"type": "string"}'
            + "}}" * 30)}})),
}


def test_hostile_requests_get_a_4xx_and_the_engine_keeps_serving(server):
    http = httpx.Client(timeout=120)
    for name, (path, body) in HOSTILE.items():
        r = http.post(server.url + path, content=body,
                      headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, name
        assert http.get(server.url + "/ready").status_code == 200, name
    r = http.post(server.url + "/v1/chat/completions",
                  headers={"X-Request-Id": "r" * 10_000}, content=_chat())
    assert r.status_code == 431 and r.json()["error"]["message"]
    for data, expected in RAW_CASES.values():
        assert_openai_error(*raw_http(server.port, data), expected)
    assert http.get(server.url + "/ready").status_code == 200
    ok = http.post(server.url + "/v1/chat/completions",
                   json={"messages": MSG, "max_tokens": 4, "temperature": 0,
                         "stop_token_ids": [1], "response_format": {"type": "json_object"}})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] in ("stop", "length")

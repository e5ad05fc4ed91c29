"""The HTTP conventions clients and browsers expect, in process (no engine is needed for most):
GET /v1/models/{id}, CORS behind --allowed-origins, the access log, and --help's defaults."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pocketllm.cli import build_parser
from pocketllm.server.app import ServerState, build_app


def call(state: ServerState, method: str, path: str, **kw):
    """(status, headers, json-or-text) of one request to an app over `state`."""
    async def run():
        async with TestClient(TestServer(build_app(state))) as client:
            r = await client.request(method, path, **kw)
            body = await (r.json() if r.content_type == "application/json" else r.text())
            return r.status, r.headers, body
    return asyncio.run(run())


def test_retrieve_model_and_unknown_id_is_an_openai_404():
    state = ServerState(model_name="org/my-model")  # ids may hold a slash
    status, _, card = call(state, "GET", "/v1/models/org/my-model")
    assert status == 200 and card["id"] == "org/my-model" and card["object"] == "model"
    status, _, body = call(state, "GET", "/v1/models/other")
    assert status == 404
    assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_cors_is_off_by_default():
    state = ServerState(model_name="m")
    status, headers, _ = call(state, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
    assert status == 405 and "Access-Control-Allow-Origin" not in headers
    _, headers, _ = call(state, "GET", "/v1/models", headers={"Origin": "http://localhost:3000"})
    assert "Access-Control-Allow-Origin" not in headers


def test_cors_preflight_and_responses_for_allowed_origins_only():
    state = ServerState(model_name="m", api_key="k",
                        allowed_origins=("http://localhost:3000",))
    status, headers, _ = call(state, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 204  # before authentication: a preflight carries no key
    assert headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert headers["Vary"] == "Origin" and int(headers["Access-Control-Max-Age"]) > 0
    # the real request (here refused for its key) can be read by the page
    status, headers, _ = call(state, "GET", "/v1/models",
                              headers={"Origin": "http://localhost:3000"})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert "X-Request-Id" in headers["Access-Control-Expose-Headers"]
    status, headers, _ = call(state, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert status == 401 and "Access-Control-Allow-Origin" not in headers  # not a preflight


def test_cors_any_origin():
    state = ServerState(model_name="m", allowed_origins=("*",))
    _, headers, _ = call(state, "GET", "/v1/models", headers={"Origin": "http://a.example"})
    assert headers["Access-Control-Allow-Origin"] == "*"


def test_access_log_one_line_per_request_and_off_switch(caplog):
    caplog.set_level(logging.DEBUG, logger="pocketllm.access")
    call(ServerState(model_name="m"), "GET", "/v1/models/m", headers={"X-Request-Id": "r-1"})
    call(ServerState(model_name="m"), "GET", "/nowhere")
    call(ServerState(model_name="m"), "GET", "/ready")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "pocketllm.access"]
    assert len(lines) == 3, lines
    level, text = lines[0]
    assert level == logging.INFO and text.startswith("GET /v1/models/m 200 id=r-1 ")
    assert "duration=" in text and "client=127.0.0.1" in text
    assert lines[1][1].startswith("GET /nowhere 404 ")
    assert lines[2][0] == logging.DEBUG and lines[2][1].startswith("GET /ready 503 ")
    caplog.clear()
    call(ServerState(model_name="m", log_requests=False), "GET", "/v1/models")
    assert not [r for r in caplog.records if r.name == "pocketllm.access"]


def _subparser(name: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[name]


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_every_option_has_help_and_shows_its_default(command):
    sub = _subparser(command)
    formatter = sub._get_formatter()
    for action in sub._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{command} {action.option_strings or action.dest} has no help"
        if action.option_strings:
            assert "default" in formatter._get_help_string(action), action.option_strings
    text = sub.format_help()
    assert "(default: 8000)" in text if command == "serve" else "(default: 128)" in text


def test_chat_and_generate_take_the_same_options():
    def options(name):
        return {s for a in _subparser(name)._actions for s in a.option_strings}
    assert options("generate") - {"--chat"} == options("chat") - {"--system"}


def test_serve_flags_reach_the_engine_and_the_server():
    from pocketllm.cli import engine_args_from

    ns = build_parser().parse_args(["serve", "--chat-template", "t.jinja", "--tool-call-parser",
                                    "hermes", "--allowed-origins", "http://a", "http://b",
                                    "--no-access-log"])
    args = engine_args_from(ns)
    assert (args.chat_template, args.tool_call_parser) == ("t.jinja", "hermes")
    assert ns.allowed_origins == ["http://a", "http://b"] and ns.no_access_log
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "mistral"])


def test_access_log_of_a_real_server_has_tokens_and_ttft(tiny_llama, tmp_path):
    import re

    import httpx

    from server_process import ServerProcess

    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log_file:
        srv = ServerProcess("--model", tiny_llama, "--served-model-name", "tiny",
                            "--max-num-batched-tokens", "64", stderr=log_file)
        try:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                    "temperature": 0, "ignore_eos": True}
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120,
                           headers={"X-Request-Id": "logged-1"})
            assert r.status_code == 200
            usage = r.json()["usage"]
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=120, json={
                    "prompt": "hi", "max_tokens": 3, "stream": True, "request_id": "logged-2"}
                              ) as s:
                assert s.status_code == 200 and list(s.iter_lines())
        finally:
            assert srv.stop() == 0
    text = log_path.read_text()
    line = re.search(r"pocketllm\.access: POST /v1/chat/completions 200 id=logged-1 .*", text)
    assert line, text[-3000:]
    assert (f"prompt_tokens={usage['prompt_tokens']} completion_tokens=5 ttft=" in line.group(0)
            and re.search(r"ttft=\d+\.\d{3}s duration=\d+\.\d{3}s", line.group(0)))
    assert re.search(r"POST /v1/completions 200 id=logged-2 prompt_tokens=\d+ "
                     r"completion_tokens=\d+ ttft=", text)
    assert "GET /ready" not in text  # probes are logged at DEBUG only


def test_sse_data_lines_survive_unicode_line_splitting():
    """Generated text may hold U+0085, U+2028 or U+2029, which str.splitlines() (httpx's
    iter_lines, many SSE readers) takes for line ends: a data line carries them escaped."""
    import json as _json

    from pocketllm.server.responses import sse

    data = {"choices": [{"text": "a\x85b\u2028c\u2029d \u00e9\n"}]}
    lines = sse(data).decode().splitlines()
    assert lines[0].startswith("data: ") and lines[1:] == [""]
    assert _json.loads(lines[0][len("data: "):]) == data

"""Tool calls end to end: the real server on a tiny random checkpoint whose template teaches
Hermes calls. A random model writes a valid call only because tool_choice's grammar makes it,
so these tests cover the request side, the grammar in the engine, the parser in the
detokenizer and the OpenAI shapes, with the openai client and langchain-openai."""

from __future__ import annotations

import json

import httpx
import pytest

from server_process import ServerProcess
from tiny_checkpoints import TOOL_CALL_ID

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
GREEDY = {"temperature": 0, "max_tokens": 128}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tool_checkpoint import make_tool_checkpoint

    path = make_tool_checkpoint(str(tmp_path_factory.mktemp("tool-server")))
    srv = ServerProcess("--model", path, "--served-model-name", "tiny-tools",
                        "--max-num-batched-tokens", "512", "--max-model-len", "512")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        if names is not None:
            assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_choice_gets_that_call_and_completes_the_round_trip(client):
    r = client.chat.completions.create(model="tiny-tools", messages=ASK, tools=TOOLS,
                                       tool_choice=NAMED, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    check_calls([call], {"get_weather"})
    # the round trip: the call goes back in the history, answered by a tool message
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    assert isinstance(history[1]["tool_calls"][0]["function"]["arguments"], str)
    r2 = client.chat.completions.create(model="tiny-tools", messages=history, tools=TOOLS,
                                        tool_choice="none", temperature=0, max_tokens=8)
    assert r2.choices[0].finish_reason in ("stop", "length")
    assert r2.choices[0].message.tool_calls is None
    base = client.chat.completions.create(model="tiny-tools", messages=ASK, tools=TOOLS,
                                          tool_choice="none", temperature=0, max_tokens=1)
    # the call and its result were rendered ("none" leaves the tools themselves out)
    assert r2.usage.prompt_tokens > base.usage.prompt_tokens + 20


def test_required_with_parallel_false_gives_exactly_one_call(client):
    for seed in range(3):
        r = client.chat.completions.create(model="tiny-tools", messages=ASK, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           temperature=1, seed=seed, max_tokens=128)
        assert r.choices[0].finish_reason == "tool_calls"
        assert len(r.choices[0].message.tool_calls) == 1
        check_calls(r.choices[0].message.tool_calls)


def test_streamed_calls_are_openai_deltas_equal_to_the_whole_answer(client):
    whole = client.chat.completions.create(model="tiny-tools", messages=ASK, tools=TOOLS,
                                           tool_choice="required", **GREEDY)
    stream = client.chat.completions.create(model="tiny-tools", messages=ASK, tools=TOOLS,
                                            tool_choice="required", stream=True, **GREEDY)
    deltas, finish, content = [], None, ""
    for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [d.index for d in deltas] == list(range(len(deltas)))
    assert all(d.id.startswith("call_") and d.type == "function" for d in deltas)
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]


def test_langchain_bind_tools_gets_tool_calls(server):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="tiny-tools",
                        temperature=0, max_tokens=128)
    for choice in ("get_time", "any"):  # langchain's spellings of named and required
        msg = llm.bind_tools(TOOLS, tool_choice=choice).invoke("What time is it in Paris?")
        assert msg.tool_calls, msg
        for call in msg.tool_calls:
            assert call["id"].startswith("call_")
            if choice == "get_time":
                assert call["name"] == "get_time"
            jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    streamed = llm.bind_tools(TOOLS, tool_choice="get_time").stream("Time in Paris?")
    total = None
    for part in streamed:
        total = part if total is None else total + part
    assert [c["name"] for c in total.tool_calls] == ["get_time"]


def test_refusals_are_400s_naming_the_field(server):
    def post(body):
        return httpx.post(server.url + "/v1/chat/completions",
                          json={"messages": ASK, **body}, timeout=60)

    for body, param in (
            ({"tools": TOOLS, "tool_choice": {"type": "function",
                                              "function": {"name": "nope"}}}, "tool_choice"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": TOOLS, "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "response_format"),
            ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
            ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages")):
        r = post(body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_auto_free_text_until_a_call_opens_then_only_that_call(client):
    # logit_bias pushes <tool_call> (token 10) wherever the grammar allows free text; auto with
    # parallel_tool_calls false then allows exactly that one well-formed call and the end
    r = client.chat.completions.create(model="tiny-tools", messages=ASK, tools=TOOLS,
                                       parallel_tool_calls=False, logit_bias={"10": 100},
                                       **GREEDY)
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(r.choices[0].message.tool_calls) == 1
    check_calls(r.choices[0].message.tool_calls)
    # without the push the random model writes text; a call it opens is well formed unless
    # the budget cuts it (then, all or nothing, the text stays content)
    r = client.chat.completions.create(model="tiny-tools", messages=ASK, tools=TOOLS,
                                       temperature=1, seed=3, max_tokens=32)
    choice = r.choices[0]
    if choice.message.tool_calls:
        check_calls(choice.message.tool_calls)
    elif "<tool_call>" in (choice.message.content or ""):
        assert choice.finish_reason == "length"


# special: the tags are special tokens, which skip_special_tokens drops unless the
# detokenizer shows them to the parser
@pytest.mark.parametrize("syntax,special", [("hermes", False), ("qwen3_xml", False),
                                            ("hermes", True)])
def test_offline_chat_exposes_tool_calls(tmp_path, syntax, special):
    from tool_checkpoint import HERMES_TEMPLATE, XML_TEMPLATE, make_tool_checkpoint

    from pocketllm import LLM, EngineArgs, SamplingParams

    template = HERMES_TEMPLATE if syntax == "hermes" else XML_TEMPLATE
    path = make_tool_checkpoint(str(tmp_path / "ckpt"), template=template,
                                special_tags=special)
    with LLM(EngineArgs(model=path, max_num_batched_tokens=512, max_model_len=512)) as llm:
        params = SamplingParams(temperature=0, max_tokens=128)
        [out] = llm.chat(ASK, params, tools=TOOLS, tool_choice="required",
                         parallel_tool_calls=False)
        assert out.finish_reason == "tool_calls" and out.text == "", out.text
        [call] = out.tool_calls
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if special:  # the tag token itself, not its spelling, reached the parser
            assert out.token_ids[0] == TOOL_CALL_ID
        events = list(llm.chat_stream(ASK, params, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False))
        streamed = [c for e in events for c in e.tool_calls]
        assert [(c.name, c.arguments) for c in streamed] == [(call.name, call.arguments)]
        assert events[-1].finish_reason == "tool_calls"


def test_http_calls_parse_when_the_tags_are_special_tokens(tmp_path):
    from tool_checkpoint import make_tool_checkpoint

    path = make_tool_checkpoint(str(tmp_path / "ckpt"), special_tags=True)
    srv = ServerProcess("--model", path, "--served-model-name", "tiny-special",
                        "--max-num-batched-tokens", "512", "--max-model-len", "512")
    try:
        special = srv.openai_client()
        r = special.chat.completions.create(model="tiny-special", messages=ASK, tools=TOOLS,
                                            tool_choice=NAMED, **GREEDY)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        assert r.choices[0].message.content is None
        check_calls(r.choices[0].message.tool_calls, {"get_weather"})
        stream = special.chat.completions.create(model="tiny-special", messages=ASK,
                                                 tools=TOOLS, tool_choice="required",
                                                 stream=True, **GREEDY)
        chunks = [c for chunk in stream for c in chunk.choices]
        assert "".join(c.delta.content or "" for c in chunks) == ""
        assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"]
        assert [d.function.name for c in chunks for d in c.delta.tool_calls or []]
        # without tools the tag is a special token like any other: skipped
        r = special.chat.completions.create(model="tiny-special", messages=ASK,
                                            logit_bias={"10": 100}, temperature=0, max_tokens=4)
        assert "<tool_call>" not in r.choices[0].message.content
    finally:
        assert srv.stop() == 0

"""The clients people point at an OpenAI-compatible server, unmodified, against the real
server on the default model (the base Gemma 3 270M, whose template has no tool syntax):
`openai`, `langchain-openai` and `litellm`, forced tool calls included, whole and streamed."""

from __future__ import annotations

import json
from typing import Literal

import pytest

from server_process import ServerProcess

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m-q4_k_m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city in the given unit",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
BUDGET = {"temperature": 0, "max_tokens": 8}  # plain text: a few tokens show the path
CALL_BUDGET = {"temperature": 0, "max_tokens": 64}  # room for a call; it ends with the grammar


@pytest.fixture(scope="module")
def server(default_model_path):
    srv = ServerProcess()  # no --model: the embedded default
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def check_weather_call(name: str, arguments: str) -> dict:
    assert name == "get_weather"
    args = json.loads(arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    return args


# ---------------------------------------------------------------- openai


def test_openai_models_list_and_retrieve(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    # the served context and, as it differs, the checkpoint's own (docs/api.md)
    assert card.model_extra["max_model_len"] == 8192
    assert card.model_extra["checkpoint_context_length"] == 32768
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_openai_chat_whole_and_streamed(client):
    whole = client.chat.completions.create(model=MODEL, messages=ASK, **BUDGET)
    text = whole.choices[0].message.content
    assert isinstance(text, str) and whole.usage.completion_tokens > 0
    stream = client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **BUDGET)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_openai_completions_whole_and_streamed(client):
    whole = client.completions.create(model=MODEL, prompt="The capital of France is",
                                      max_tokens=8, temperature=0)
    assert whole.choices[0].text and whole.usage.prompt_tokens > 0
    stream = client.completions.create(model=MODEL, prompt="The capital of France is",
                                       max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text


@pytest.mark.parametrize("choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_openai_forced_tool_call_whole_and_streamed(client, choice):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice,
              parallel_tool_calls=False, **CALL_BUDGET)
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and msg.content is None
    [call] = msg.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    check_weather_call(call.function.name, call.function.arguments)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0
    assert (deltas[0].function.name, deltas[0].function.arguments) == (
        call.function.name, call.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_openai_auto_tools_on_a_template_without_tool_syntax_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], **BUDGET)
    assert e.value.body["param"] == "tools" and "--tool-call-parser" in e.value.body["message"]


# ---------------------------------------------------------------- langchain-openai


@pytest.fixture(scope="module")
def chat_model(server):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL,
                         temperature=0, max_tokens=64, max_retries=0)


def _weather_model():
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """The weather of a city in the given unit"""
        city: str = Field(max_length=20, description="the city")
        unit: Literal["celsius", "fahrenheit"]

    return Weather


def test_langchain_bind_tools_with_a_forced_call(chat_model):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather of a city in the given unit"""
        return "sunny"

    reply = chat_model.bind_tools([get_weather], tool_choice="get_weather").invoke(ASK)
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert isinstance(call["args"]["city"], str) and call["args"]["unit"] in ("celsius",
                                                                            "fahrenheit")
    assert not reply.invalid_tool_calls


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(chat_model, method):
    weather = _weather_model()
    out = chat_model.with_structured_output(weather, method=method).invoke(ASK)
    assert isinstance(out, weather) and len(out.city) <= 20


# ---------------------------------------------------------------- litellm


@pytest.fixture(scope="module")
def litellm_kw(server):
    pytest.importorskip("litellm", reason="litellm is not installed (pip install litellm)")
    return {"model": "openai/" + MODEL, "api_base": server.url + "/v1", "api_key": "unused",
            "num_retries": 0}


def test_litellm_chat_whole_and_streamed(litellm_kw, client):
    import litellm

    whole = litellm.completion(messages=ASK, **litellm_kw, **BUDGET)
    text = whole.choices[0].message.content
    assert text == client.chat.completions.create(
        model=MODEL, messages=ASK, **BUDGET).choices[0].message.content
    stream = litellm.completion(messages=ASK, stream=True, **litellm_kw, **BUDGET)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_litellm_forced_tool_call(litellm_kw):
    import litellm

    out = litellm.completion(messages=ASK, tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}, **litellm_kw, **CALL_BUDGET)
    [call] = out.choices[0].message.tool_calls
    check_weather_call(call.function.name, call.function.arguments)
    assert out.choices[0].finish_reason == "tool_calls"

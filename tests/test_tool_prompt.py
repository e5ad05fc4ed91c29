"""Tools on a template that cannot show them (the default Gemma's): the system message, the
history as text, the grammar that forces the call, and --tool-call-parser / --chat-template."""

from __future__ import annotations

import json

import pytest

from pocketllm import EngineArgs
from pocketllm.errors import CheckpointError, InvalidRequestError
from pocketllm.model_info import DEFAULT_MAX_MODEL_LEN_CAP, load_model_info
from pocketllm.protocol.tool_prompt import (call_text, template_shows_tools, tools_system_text,
                                            with_tools_in_text)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_system_text_lists_the_tools_and_the_syntax():
    text = tools_system_text([WEATHER], "hermes", "required", True)
    lines = text.splitlines()
    listed = lines[lines.index("<functions>") + 1]
    assert json.loads(listed) == {"name": "get_weather", **{
        k: WEATHER["function"][k] for k in ("description", "parameters")}}
    assert '{"name": "FUNCTION_NAME", "arguments":' in text
    assert "write nothing else" in lines[-1]
    assert "get_weather" in tools_system_text([WEATHER], "hermes", NAMED, True).splitlines()[-1]
    assert "<function=FUNCTION_NAME>" in tools_system_text([WEATHER], "qwen3_xml", "auto", True)


def test_messages_get_the_tools_in_the_system_message_and_the_history_as_text():
    history = [{"role": "system", "content": "Be brief."}, *ASK,
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
               {"role": "tool", "tool_call_id": "c2", "content": "windy"}]
    out = with_tools_in_text(history, "hermes", [WEATHER], "auto")
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n")
    assert out[2] == {"role": "assistant", "content": call_text(
        "hermes", "get_weather", {"city": "Paris"})}
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>\n"
                                                 "<tool_response>\nwindy\n</tool_response>"}
    assert len(out) == 4 and history[0]["content"] == "Be brief."  # the input is untouched
    assert with_tools_in_text(ASK, "hermes", [WEATHER])[0]["role"] == "system"
    assert call_text("qwen3_xml", "f", {"a": 1, "b": "x"}) == (
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nx\n"
        "</parameter>\n</function>\n</tool_call>")


def test_template_shows_tools():
    assert template_shows_tools("{% for t in tools %}{{ t }}{% endfor %}")
    assert not template_shows_tools("{{ messages }} toolset") and not template_shows_tools(None)


@pytest.fixture(scope="module")
def gemma_info(default_model_path):
    return load_model_info(EngineArgs(model=default_model_path))


def stage_chat(stage, messages=ASK, **tool_fields):
    from pocketllm.api.requests import chat_request
    from pocketllm.sampling import SamplingParams

    return stage.handle(chat_request(messages, SamplingParams(max_tokens=8), **tool_fields))


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_default_model_forces_calls_in_the_hermes_syntax(gemma_info, choice):
    from pocketllm.tokenizer.stage import TokenizerStage

    stage = TokenizerStage(gemma_info)
    out = stage_chat(stage, tools=[WEATHER], tool_choice=choice)
    prompt = stage.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert "<functions>\n" + json.dumps({"name": "get_weather", **{
        k: WEATHER["function"][k] for k in ("description", "parameters")}}) in prompt
    assert out.detok.split.tool_parser == "hermes" and out.detok.split.tools == [WEATHER]
    tag = json.loads(out.sampling.structured.value)
    assert tag["type"] == "structural_tag" and out.sampling.structured.param == "tools"
    assert '"begin": "<tool_call>\\n{\\"name\\": \\"get_weather\\"' in out.sampling.structured.value
    assert "dispatch" not in out.sampling.structured.value  # no free text before the call


def test_default_model_auto_is_refused_unless_a_parser_is_named(gemma_info):
    from pocketllm.tokenizer.stage import TokenizerStage

    out = stage_chat(TokenizerStage(gemma_info), tools=[WEATHER])
    assert out.kind == "unsupported" and out.param == "tools"
    assert "--tool-call-parser" in out.message and '"required"' in out.message
    for syntax in ("hermes", "qwen3_xml"):
        stage = TokenizerStage(gemma_info, tool_call_parser=syntax)
        out = stage_chat(stage, tools=[WEATHER])
        assert out.detok.split.tool_parser == syntax and "dispatch" in out.sampling.structured.value
        prompt = stage.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
        assert ("<function=FUNCTION_NAME>" in prompt) == (syntax == "qwen3_xml")
    none = stage_chat(TokenizerStage(gemma_info), tools=[WEATHER], tool_choice="none")
    assert none.prompt_token_ids == stage_chat(TokenizerStage(gemma_info)).prompt_token_ids


def test_tool_call_parser_is_validated():
    with pytest.raises(InvalidRequestError) as e:
        EngineArgs(tool_call_parser="mistral")
    assert e.value.param == "tool_call_parser"


def test_chat_template_file_overrides_and_a_missing_one_is_a_startup_error(
        default_model_path, tmp_path):
    from pocketllm.tokenizer.stage import TokenizerStage

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    info = load_model_info(EngineArgs(model=default_model_path, chat_template=str(path)))
    stage = TokenizerStage(info)
    out = stage_chat(stage)
    assert stage.tokenizer.decode(out.prompt_token_ids) == "[user] Weather in Paris?\n"
    with pytest.raises(CheckpointError, match="--chat-template"):
        load_model_info(EngineArgs(model=default_model_path,
                                   chat_template=str(tmp_path / "missing.jinja")))


def test_context_length_is_the_checkpoints_and_max_model_len_the_capped_one(gemma_info,
                                                                            default_model_path):
    assert gemma_info.context_length == 32768  # what the GGUF says
    assert gemma_info.max_model_len == DEFAULT_MAX_MODEL_LEN_CAP == 8192
    longer = load_model_info(EngineArgs(model=default_model_path, max_model_len=16384))
    assert (longer.max_model_len, longer.context_length) == (16384, 32768)

"""tool_choice / parallel_tool_calls: field validation, the structural tags that enforce them
(checked directly against xgrammar, token by token over the tiny tokenizer), the tokenizer
stage's wiring, and assistant tool_calls in the chat history."""

from __future__ import annotations

import copy
import json
import random

import pytest

from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError
from pocketllm.proto.messages import OutputSplit, SamplingSpec
from pocketllm.protocol.chat import normalize_messages
from pocketllm.protocol.tool_choice import (structural_tag, take_tool_options, tool_options,
                                            tool_split)
from pocketllm.protocol.tool_parsers import get_tool_parser

xgr = pytest.importorskip("xgrammar")


def tool(name, properties, required=()):
    return {"type": "function", "function": {
        "name": name, "description": f"{name} tool",
        "parameters": {"type": "object", "properties": properties, "required": list(required)}}}


WEATHER = tool("get_weather", {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
               required=["city", "days"])
TIME = tool("get_time", {"tz": {"type": "string", "maxLength": 8}}, required=["tz"])
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_time"}}


# ---------------------------------------------------------------- field validation

def test_tool_options_shapes():
    assert tool_options(None) == {}
    assert tool_options(None, "none") == {} and tool_options(None, "auto") == {}
    assert tool_options(None, None, False) == {}  # nothing to limit
    assert tool_options(TOOLS, "none") == {}  # "none": neither rendered nor parsed
    assert tool_options(TOOLS) == {"tools": TOOLS, "tool_choice": "auto",
                                   "parallel_tool_calls": True}
    assert tool_options(TOOLS, NAMED, False)["tool_choice"] == NAMED
    assert tool_options(TOOLS, "required", response_format={"type": "text"})["parallel_tool_calls"]


@pytest.mark.parametrize("args, kwargs, param", [
    ((None, "required"), {}, "tool_choice"),
    ((TOOLS, "always"), {}, "tool_choice"),
    ((TOOLS, {"type": "function", "function": {"name": "nope"}}), {}, "tool_choice"),
    ((TOOLS, {"type": "function"}), {}, "tool_choice"),
    ((TOOLS, {"function": {"name": "get_time"}}), {}, "tool_choice"),
    ((TOOLS, "auto", "yes"), {}, "parallel_tool_calls"),
    (([tool("get weather", {})],), {}, "tools"),
    (([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],), {},
     "tools"),
    (([{"type": "function"}],), {}, "tools"),
    ((TOOLS, "required"), {"response_format": {"type": "json_object"}}, "response_format"),
    ((TOOLS,), {"response_format": {"type": "json_object"}}, "response_format"),
    ((None,), {"template_kwargs": {"tools": TOOLS}}, "chat_template_kwargs"),
])
def test_tool_options_refusals(args, kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        tool_options(*args, **kwargs)
    assert e.value.param == param


def test_take_tool_options_keeps_only_template_variables():
    opts = {"x": 1, **tool_options(TOOLS, "required", False)}
    req = take_tool_options(opts)
    assert opts == {"x": 1, "tools": TOOLS} and req.choice == "required" and not req.parallel
    opts = {"x": 1}
    assert take_tool_options(opts).tools is None and opts == {"x": 1}


def test_tool_split_refuses_a_template_without_a_call_syntax():
    req = take_tool_options(tool_options(TOOLS))
    with pytest.raises(UnsupportedFeatureError) as e:
        tool_split(req, None, None, SamplingSpec())
    assert e.value.param == "tools"
    split, sampling = tool_split(req, get_tool_parser("hermes"),
                                 OutputSplit(reasoning_start_id=8, reasoning_end_id=9),
                                 SamplingSpec())
    assert (split.tool_parser, split.tools, split.reasoning_end_id) == ("hermes", TOOLS, 9)
    assert sampling.structured.kind == "structural_tag" and sampling.structured.param == "tools"
    assert json.loads(sampling.structured.value)["type"] == "structural_tag"


# ---------------------------------------------------------------- grammars, against xgrammar

@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    """The tiny checkpoint's byte-level BPE vocabulary, tool tags as single tokens."""
    from tiny_checkpoints import EOS_ID, make_tiny_checkpoint
    from tokenizers import Tokenizer

    path = make_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("tool-vocab")))
    tok = Tokenizer.from_file(path + "/tokenizer.json")
    encoded = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    info = xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType.BYTE_LEVEL,
                             stop_token_ids=[EOS_ID])
    return tok, xgr.GrammarCompiler(info), EOS_ID


def matcher(vocab, tag):
    _, compiler, _ = vocab
    return xgr.GrammarMatcher(compiler.compile_grammar(xgr.Grammar.from_structural_tag(tag)))


def accepts(vocab, tag, text):
    """The grammar takes `text`, and may end (the stop token) right after it."""
    m = matcher(vocab, tag)
    return m.accept_string(text) and m.accept_token(vocab[2])


def h_call(name, args):
    return '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (name, json.dumps(args))


def x_call(name, args):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


P1, P2 = ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})
BAD_ARGS = ("get_weather", {"city": "Rome", "days": 3})  # not in the enum
CASES = [
    # choice, parallel, accepted, refused
    ("auto", True, ["Hello.", "", "Let me check.\n{1}", "{1}", "{1}\n{2}", "{1}\n{2}\n{1}"],
     ["{1} and more prose", "{1}{2}", "{bad}", "{1}\n"]),
    ("auto", False, ["Hello.", "Sure: {1}", "{2}"], ["{1}\n{2}", "{1} done"]),
    ("required", True, ["{1}", "{2}", "{1}\n{2}"], ["", "Hi", "Hi {1}", "{bad}", "{1} done"]),
    ("required", False, ["{1}", "{2}"], ["{1}\n{2}", "", "x{1}"]),
    (NAMED, True, ["{2}"], ["{1}", "{2}\n{2}", "", "Hi {2}", "{2} x"]),
    (NAMED, False, ["{2}"], ["{1}", "{2}\n{2}"]),
]


def fill(template, call):
    return template.replace("{1}", call(*P1)).replace("{2}", call(*P2)).replace(
        "{bad}", call(*BAD_ARGS))


@pytest.mark.parametrize("syntax, call", [("hermes", h_call), ("qwen3_xml", x_call)])
@pytest.mark.parametrize("choice, parallel, good, bad", CASES)
def test_grammar_enforces_the_choice(vocab, syntax, call, choice, parallel, good, bad):
    tag = structural_tag(syntax, TOOLS, choice, parallel)
    parser = get_tool_parser(syntax)
    for text in good:
        text = fill(text, call)
        assert accepts(vocab, tag, text), text
        parsed = parser.parse(text, TOOLS)
        assert len(parsed.tool_calls) == text.count("<tool_call>"), text  # every call parses
    for text in bad:
        assert not accepts(vocab, tag, fill(text, call)), text


def test_thinking_block_comes_first_unconstrained(vocab):
    opened = OutputSplit(reasoning_start_id=8, reasoning_end_id=9, in_reasoning=True)
    tag = structural_tag("hermes", TOOLS, "required", True, opened)
    call = h_call(*P1)
    assert accepts(vocab, tag, "I could say <tool_call> here.</think>\n\n" + call)
    assert not accepts(vocab, tag, call)  # the block the prompt opened must close first
    assert not accepts(vocab, tag, "hmm</think>\n\nprose")
    optional = OutputSplit(reasoning_start_id=8, reasoning_end_id=9)
    tag = structural_tag("hermes", TOOLS, NAMED, True, optional)
    assert accepts(vocab, tag, h_call(*P2))
    assert accepts(vocab, tag, "<think>why</think>\n" + h_call(*P2))
    # auto: a <tool_call> inside the open block is reasoning, not a call
    tag = structural_tag("hermes", TOOLS, "auto", False, opened)
    assert accepts(vocab, tag, "maybe <tool_call> x</think>\n\n" + call)


def random_walk(vocab, tag, rng, max_tokens=160):
    """Sample uniformly among the tokens the grammar allows; end when the stop token is drawn."""
    import torch

    tok, _, eos = vocab
    m = matcher(vocab, tag)
    mask = xgr.allocate_token_bitmask(1, tok.get_vocab_size())
    ids = []
    for _ in range(max_tokens):
        m.fill_next_token_bitmask(mask)
        allowed = [i for i in range(tok.get_vocab_size())
                   if (int(mask[0, i // 32]) >> (i % 32)) & 1]
        if eos in allowed and (rng.random() < 0.3 or len(allowed) == 1):
            return tok.decode(ids, skip_special_tokens=False), True
        choice = rng.choice([i for i in allowed if i != eos])
        assert m.accept_token(choice)
        ids.append(choice)
    del torch
    return tok.decode(ids, skip_special_tokens=False), False


@pytest.mark.parametrize("syntax", ["hermes", "qwen3_xml"])
def test_every_complete_output_the_grammar_allows_parses(vocab, syntax):
    """Random tokens through the grammar: whatever completes is calls the parser accepts, with
    names among the tools and arguments valid under their schemas."""
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    parser = get_tool_parser(syntax)
    rng = random.Random(7)
    done = 0
    for choice, parallel in (("required", True), ("required", False), (NAMED, False)):
        tag = structural_tag(syntax, TOOLS, choice, parallel)
        for _ in range(4):
            text, complete = random_walk(vocab, tag, rng)
            if not complete:
                continue
            done += 1
            parsed = parser.parse(text, TOOLS)
            assert parsed.tool_calls and parsed.content == "", text
            if not parallel:
                assert len(parsed.tool_calls) == 1
            for call in parsed.tool_calls:
                if isinstance(choice, dict):
                    assert call.name == "get_time"
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert done >= 6


# ---------------------------------------------------------------- chat history

def test_assistant_tool_calls_get_object_arguments_on_a_private_copy():
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time",
                                                              "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    before = copy.deepcopy(messages)
    out = normalize_messages(messages)
    assert messages == before
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert out[1]["tool_calls"][1]["function"]["arguments"] == {}
    assert out[1]["content"] == "" and out[2]["tool_call_id"] == "call_1"


@pytest.mark.parametrize("bad", [
    {"role": "assistant", "content": None, "tool_calls": "x"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]},
    {"role": "tool", "content": "sunny"},  # which call does it answer?
])
def test_bad_tool_messages_are_400s(bad):
    with pytest.raises(InvalidRequestError) as e:
        normalize_messages([{"role": "user", "content": "x"}, bad])
    assert e.value.param == "messages"


# ---------------------------------------------------------------- the tokenizer stage

@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    from tool_checkpoint import make_tool_checkpoint

    from pocketllm import EngineArgs
    from pocketllm.model_info import load_model_info
    from pocketllm.tokenizer.stage import TokenizerStage

    path = make_tool_checkpoint(str(tmp_path_factory.mktemp("tool-ckpt")))
    return TokenizerStage(load_model_info(EngineArgs(model=path)))


def chat(stage, messages, **tool_fields):
    from pocketllm.api.requests import chat_request
    from pocketllm.sampling import SamplingParams

    return stage.handle(chat_request(messages, SamplingParams(max_tokens=8), **tool_fields))


def test_stage_renders_tools_and_sets_parser_and_grammar(stage):
    msgs = [{"role": "user", "content": "Weather?"}]
    out = chat(stage, msgs, tools=TOOLS, tool_choice="required")
    prompt = stage.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert out.detok.split.tool_parser == "hermes" and out.detok.split.tools == TOOLS
    assert out.sampling.structured.kind == "structural_tag"
    none = chat(stage, msgs, tools=TOOLS, tool_choice="none")
    assert none.detok.split is None and none.sampling.structured is None
    assert "<tools>" not in stage.tokenizer.decode(none.prompt_token_ids)
    assert none.prompt_token_ids == chat(stage, msgs).prompt_token_ids


def test_stage_refuses_an_unenforceable_schema_naming_tools(stage):
    bad = tool("f", {"x": {"type": "string", "pattern": "(unclosed"}})
    out = chat(stage, [{"role": "user", "content": "x"}], tools=[bad], tool_choice="required")
    assert out.kind == "invalid_request" and out.param == "tools", out


def test_stage_round_trip_history_renders_arguments_as_json(stage):
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = chat(stage, msgs, tools=[WEATHER])  # the tiny model's context is 512 tokens
    prompt = stage.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call>') in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_xml_template_iterates_the_history_arguments(tmp_path):
    from tool_checkpoint import XML_TEMPLATE, make_tool_checkpoint

    from pocketllm import EngineArgs
    from pocketllm.model_info import load_model_info
    from pocketllm.tokenizer.stage import TokenizerStage

    path = make_tool_checkpoint(str(tmp_path / "xml"), template=XML_TEMPLATE)
    stage = TokenizerStage(load_model_info(EngineArgs(model=path)))
    assert stage.tool_parser.name == "qwen3_xml"
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = chat(stage, msgs, tools=[WEATHER], tool_choice=NAMED_WEATHER)
    prompt = stage.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n</function>") in prompt
    assert out.detok.split.tool_parser == "qwen3_xml"
    assert '"style": "qwen_xml"' in out.sampling.structured.value


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}

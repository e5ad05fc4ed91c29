"""Tool-call parsers on hand-written model text in the shapes Qwen3 (Hermes JSON) and
Qwen3-Coder / qwen3_5 (XML) templates teach: typing, all-or-nothing, and streaming
that matches the whole-text parse under any chunking without leaking markup."""

from __future__ import annotations

import itertools
import json
import random
import zlib

import pytest

from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError
from pocketllm.protocol.chat import ChatRenderer
from pocketllm.protocol.tool_parsers import (Delta, HermesToolParser, Qwen3XmlToolParser,
                                             get_tool_parser, new_call_id, parser_for_template)


def counting_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter):024x}"


def hermes():
    return HermesToolParser(counting_ids())


def xml():
    return Qwen3XmlToolParser(counting_ids())


def tool(name, properties):
    return {"type": "function", "function": {
        "name": name, "description": f"{name} tool",
        "parameters": {"type": "object", "properties": properties}}}


WEATHER = tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}})
TIME = tool("get_time", {"timezone": {"type": "string"}})
TYPED = tool("configure", {
    "name": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
    "big": {"type": "number"}, "enabled": {"type": "boolean"}, "off": {"type": "boolean"},
    "options": {"type": "object"}, "tags": {"type": "array"}, "maybe": {"type": ["integer", "null"]},
    "gone": {"type": ["integer", "null"]}, "untyped": {"description": "no type"},
    "weird": {"type": "datetime"}, "code": {"type": "string"}, "zip": {"type": "integer"},
    "bad_count": {"type": "integer"}, "bad_bool": {"type": "boolean"},
    "bad_obj": {"type": "object"}, "arr_as_obj": {"type": "object"}, "inf": {"type": "number"}})
TOOLS = [WEATHER, TIME]

# ---- recorded-shape samples ------------------------------------------------------------

H_ONE = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
         '</tool_call>')
H_TWO = (H_ONE + '\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}'
         '\n</tool_call>')
H_PROSE = "I'll check the weather in Paris for you.\n\n" + H_ONE + "\n"
H_TRUNCATED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
H_NO_CLOSE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
H_BAD_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>'
H_BETWEEN = H_ONE + "\nNow the time:\n" + H_TWO[len(H_ONE):]
H_AFTER = H_ONE + "\nLet me know if you need more."
H_UNKNOWN = '<tool_call>\n{"name": "send_email", "arguments": {"to": "a@b.c"}}\n</tool_call>'
H_UNICODE = ('Je vérifie… 🌦\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Zürich 東京"}}\n</tool_call>')


def x_call(name, *params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


X_ONE = x_call("get_weather", ("city", "Paris"), ("days", "3"))
X_TWO = X_ONE + "\n" + x_call("get_time", ("timezone", "Asia/Tokyo"))
X_PROSE = "Let me look that up.\n\n" + X_ONE
X_TRUNCATED = X_ONE[:X_ONE.index("</parameter>", X_ONE.index("days"))]
X_NO_CALL_CLOSE = X_ONE[:-len("</tool_call>")]
X_BROKEN = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"
X_BETWEEN = X_ONE + "\nand also\n" + x_call("get_time", ("timezone", "UTC"))
X_AFTER = X_ONE + "\nDone."
X_UNICODE = "Ça marche 👍\n" + x_call("get_weather", ("city", "Zürich 東京"), ("days", "2"))
X_CODE = x_call("configure", ("code", "def f():\n    return '<tool_call>'\n"))

VALID = [(hermes, TOOLS, t) for t in (H_ONE, H_TWO, H_PROSE, H_UNICODE)] + \
        [(xml, TOOLS, t) for t in (X_ONE, X_TWO, X_PROSE, X_UNICODE)] + \
        [(xml, [TYPED], X_CODE), (xml, None, X_TWO), (hermes, None, H_TWO)]
INVALID = [(hermes, TOOLS, t) for t in (H_TRUNCATED, H_NO_CLOSE, H_BAD_JSON, H_BETWEEN, H_AFTER,
                                         H_UNKNOWN)] + \
          [(xml, TOOLS, t) for t in (X_TRUNCATED, X_NO_CALL_CLOSE, X_BROKEN, X_BETWEEN, X_AFTER)]
PLAIN = ["The weather in Paris is sunny.", "", "Use <tool_call> tags? No.  \n", "a < b\n\n",
         "Trailing partial <tool_"]


def calls_of(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


# ---- whole-text parse ------------------------------------------------------------------

def test_hermes_single_call():
    parsed = hermes().parse(H_ONE, TOOLS)
    assert parsed.content == ""
    assert calls_of(parsed) == [("get_weather", {"city": "Paris", "days": 3})]
    call = parsed.tool_calls[0]
    assert call.arguments == '{"city":"Paris","days":3}'  # compact re-serialization
    assert call.as_openai() == {"id": call.id, "type": "function", "function": {
        "name": "get_weather", "arguments": call.arguments}}


def test_two_calls_in_order_with_distinct_ids():
    for parser, text in ((hermes(), H_TWO), (xml(), X_TWO)):
        parsed = parser.parse(text, TOOLS)
        assert [c.name for c in parsed.tool_calls] == ["get_weather", "get_time"]
        assert parsed.tool_calls[0].id != parsed.tool_calls[1].id
        assert parsed.content == ""


def test_prose_before_the_first_call_is_content():
    parsed = hermes().parse(H_PROSE, TOOLS)
    assert parsed.content == "I'll check the weather in Paris for you."
    assert calls_of(parsed) == [("get_weather", {"city": "Paris", "days": 3})]
    parsed = xml().parse(X_PROSE, TOOLS)
    assert parsed.content == "Let me look that up."
    assert calls_of(parsed) == [("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize("make,tools,text", INVALID)
def test_all_or_nothing_failures_keep_the_text_exactly(make, tools, text):
    parsed = make().parse(text, tools)
    assert parsed.tool_calls == []
    assert parsed.content == text


@pytest.mark.parametrize("text", PLAIN)
def test_text_without_calls_is_unchanged(text):
    for make in (hermes, xml):
        assert make().parse(text, TOOLS).content == text
        assert make().parse(text, TOOLS).tool_calls == []


def test_unknown_function_fails_only_when_tools_were_given():
    assert hermes().parse(H_UNKNOWN, TOOLS).tool_calls == []
    assert calls_of(hermes().parse(H_UNKNOWN, None)) == [("send_email", {"to": "a@b.c"})]
    x_unknown = x_call("send_email", ("to", "a@b.c"))
    assert xml().parse(x_unknown, TOOLS).tool_calls == []
    assert calls_of(xml().parse(x_unknown, [])) == [("send_email", {"to": "a@b.c"})]


def test_hermes_strict_body():
    for body in ('{"name": "get_time", "arguments": "{\\"timezone\\": \\"UTC\\"}"}',  # string args
                 '{"name": "get_time"}', '{"name": "get_time", "arguments": {}, "id": 1}',
                 '{"name": "", "arguments": {}}', '["get_time", {}]',
                 '{"name": "get_time", "arguments": {"x": NaN}}',
                 '{"name": "get_time", "arguments": {}} trailing'):
        text = f"<tool_call>\n{body}\n</tool_call>"
        assert hermes().parse(text, None).tool_calls == [], body


def test_hermes_arguments_passed_through_untyped():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "3", '
            '"extra": {"a": [1, 2.5, null, true]}}}\n</tool_call>')
    assert calls_of(hermes().parse(text, TOOLS)) == [
        ("get_weather", {"city": "Paris", "days": "3", "extra": {"a": [1, 2.5, None, True]}})]


def test_hermes_json_may_contain_the_closing_tag():
    text = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "</tool_call>"}}\n</tool_call>'
    assert calls_of(hermes().parse(text, TOOLS)) == [("get_time", {"timezone": "</tool_call>"})]


def test_xml_typing_by_the_request_schema():
    text = x_call(
        "configure", ("name", "  spaced name  "), ("count", "3"), ("ratio", "0.25"),
        ("big", "12345678901234567890"), ("enabled", "true"), ("off", "false"),
        ("options", '{"depth": {"max": 2}, "list": [1, "two"]}'), ("tags", '["a", "b", {"c": 1}]'),
        ("maybe", "null"), ("gone", "seven"), ("untyped", "42"), ("weird", "2024-01-01"),
        ("zip", "01234"), ("bad_count", "3.0"), ("bad_bool", "True"), ("bad_obj", "{not json}"),
        ("arr_as_obj", "[1, 2]"), ("inf", "1e999"), ("not_declared", "5"))
    [(name, args)] = calls_of(xml().parse(text, [TYPED]))
    assert name == "configure"
    assert args == {
        "name": "  spaced name  ", "count": 3, "ratio": 0.25, "big": 12345678901234567890,
        "enabled": True, "off": False, "options": {"depth": {"max": 2}, "list": [1, "two"]},
        "tags": ["a", "b", {"c": 1}], "maybe": None, "gone": "seven", "untyped": "42",
        "weird": "2024-01-01", "zip": "01234", "bad_count": "3.0", "bad_bool": "True",
        "bad_obj": "{not json}", "arr_as_obj": "[1, 2]", "inf": "1e999", "not_declared": "5"}
    assert isinstance(args["count"], int) and isinstance(args["ratio"], float)


def test_xml_without_tools_every_argument_is_a_string():
    [(_, args)] = calls_of(xml().parse(x_call("configure", ("count", "3"), ("enabled", "true"),
                                              ("tags", "[1]")), None))
    assert args == {"count": "3", "enabled": "true", "tags": "[1]"}


def test_xml_strips_exactly_one_newline_each_side():
    text = ("<tool_call>\n<function=configure>\n<parameter=code>\n\n  x = 1\n\n\n</parameter>\n"
            "<parameter=name>\n</parameter>\n<parameter=count>7</parameter>\n</function>\n</tool_call>")
    [(_, args)] = calls_of(xml().parse(text, [TYPED]))
    assert args == {"code": "\n  x = 1\n\n", "name": "", "count": 7}


def test_xml_value_may_hold_markup_and_multiline_code():
    [(_, args)] = calls_of(xml().parse(X_CODE, [TYPED]))
    assert args == {"code": "def f():\n    return '<tool_call>'\n"}


def test_xml_malformed_shapes_fail():
    for text in ("<tool_call>\n<function=get_time>\n<parameter=timezone>\nUTC\n</parameter>\n</tool_call>",
                 "<tool_call>\n<function=get time>\n</function>\n</tool_call>",
                 "<tool_call>\n<function=>\n</function>\n</tool_call>",
                 "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
                 x_call("get_time", ("timezone", "UTC"), ("timezone", "CET")),
                 "<tool_call>\n<function=get_time>\nUTC\n</function>\n</tool_call>"):
        assert xml().parse(text, TOOLS).tool_calls == [], text


def test_unicode_survives_unescaped():
    parsed = xml().parse(X_UNICODE, TOOLS)
    assert parsed.content == "Ça marche 👍"
    assert parsed.tool_calls[0].arguments == '{"city":"Zürich 東京","days":2}'
    assert calls_of(hermes().parse(H_UNICODE, TOOLS)) == [("get_weather", {"city": "Zürich 東京"})]


def test_default_ids_have_openai_shape():
    parsed = HermesToolParser().parse(H_TWO, TOOLS)
    for call in parsed.tool_calls:
        assert call.id.startswith("call_") and len(call.id) == 29
        int(call.id[5:], 16)
    assert parsed.tool_calls[0].id != parsed.tool_calls[1].id != new_call_id()


def test_bad_tools_are_invalid_requests():
    for tools in ("x", [{"type": "function"}], [{"function": {"name": "f"}}],
                  [tool("f", {}), tool("f", {})], [tool("f", [])],
                  [{"type": "function", "function": {"name": "f", "parameters": 3}}]):
        with pytest.raises(InvalidRequestError):
            hermes().parse("no calls here", tools)
        with pytest.raises(InvalidRequestError):
            xml().stream(tools)


# ---- registry and template detection ---------------------------------------------------

QWEN3_TEMPLATE = ('{{- "For each function call, return a json object with function name and arguments '
                  'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
                  '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>" }}')
QWEN3_CODER_TEMPLATE = ("{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
                        "{{- '<parameter=' + args_name + '>\\n' }}{{ args_value | tojson }}")


def test_registry_and_template_detection():
    assert get_tool_parser("hermes").name == "hermes"
    assert get_tool_parser("qwen3_xml").name == "qwen3_xml"
    with pytest.raises(UnsupportedFeatureError):
        get_tool_parser("mistral")
    assert parser_for_template(QWEN3_TEMPLATE).name == "hermes"
    assert parser_for_template(QWEN3_CODER_TEMPLATE).name == "qwen3_xml"
    assert parser_for_template("{{ messages }}") is None
    assert parser_for_template(None) is None
    # the built-in template stands in for a checkpoint without one: Gemma's teaches no calls
    assert parser_for_template(ChatRenderer(None, "gemma3", {}).template_source) is None
    ids = counting_ids()
    assert get_tool_parser("hermes", id_factory=ids).parse(H_ONE, TOOLS).tool_calls[0].id == \
        "call_" + "0" * 24


# ---- streaming -------------------------------------------------------------------------

def random_chunks(text, rng):
    chunks, pos = [], 0
    while pos < len(text):
        step = rng.choice((1, 1, 2, 3, 5, 8, 13))
        chunks.append(text[pos:pos + step])
        pos += step
    return chunks


def run_stream(make, tools, chunks):
    stream = make().stream(tools)
    deltas: list[Delta] = []
    for chunk in chunks:
        deltas += stream.feed(chunk)
    deltas += stream.finish()
    assert all(d.content for d in deltas if d.tool_call is None), "no empty content deltas"
    content = "".join(d.content for d in deltas if d.tool_call is None)
    calls = [d.tool_call for d in deltas if d.tool_call is not None]
    return content, calls


ALL_SAMPLES = VALID + INVALID + [(m, TOOLS, t) for t in PLAIN for m in (hermes, xml)]


@pytest.mark.parametrize("make,tools,text", ALL_SAMPLES)
def test_stream_equals_whole_parse_under_any_chunking(make, tools, text):
    whole = make().parse(text, tools)
    expected_calls = [c.as_openai(i) for i, c in enumerate(whole.tool_calls)]
    rng = random.Random(zlib.crc32(text.encode()))
    chunkings = [[text], list(text)] + [random_chunks(text, rng) for _ in range(15)]
    for chunks in chunkings:
        content, calls = run_stream(make, tools, chunks)
        assert content == whole.content
        assert calls == expected_calls
        if whole.tool_calls:  # vllm#28297: markup of a parsed call never reaches content
            for tag in ("<tool_call", "</tool_call", "<function=", "<parameter=", "<tool_"):
                assert tag not in content


def test_stream_emits_prose_promptly_and_holds_only_a_possible_tag():
    stream = xml().stream(TOOLS)
    assert [d.content for d in stream.feed("Hello world")] == ["Hello world"]
    assert [d.content for d in stream.feed(", checking \n<tool")] == [", checking"]
    assert [d.content for d in stream.feed("box> is a tag")] == [" \n<toolbox> is a tag"]
    assert stream.feed("\n\n<tool_call>\n<function=get_time>") == []  # held from here on
    stream.feed("\n<parameter=timezone>\nUTC\n</parameter>\n</function>\n</tool_call>")
    [delta] = stream.finish()
    assert delta.as_openai() == {"tool_calls": [{
        "index": 0, "id": delta.tool_call["id"], "type": "function",
        "function": {"name": "get_time", "arguments": '{"timezone":"UTC"}'}}]}


def test_stream_releases_an_unfinished_call_as_content():
    stream = hermes().stream(TOOLS)
    sent = "".join(d.content for d in stream.feed("Checking.\n" + H_TRUNCATED[:20]))
    assert sent == "Checking."
    stream.feed(H_TRUNCATED[20:])
    [delta] = stream.finish()
    assert sent + delta.content == "Checking.\n" + H_TRUNCATED
    assert delta.as_openai() == {"content": "\n" + H_TRUNCATED}


def test_stream_misuse_raises():
    stream = hermes().stream(None)
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.feed("x")
    with pytest.raises(RuntimeError):
        stream.finish()


# ---- typing rules the tool_choice grammar relies on (xgrammar's qwen_xml and JSON styles) ----

def test_xml_typing_of_unions_enums_and_checked_strings():
    shapes = tool("shapes", {
        "any": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "one": {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
        "mixed": {"enum": ["ab", 3]}, "mixed_s": {"enum": ["ab", 3]}, "fixed": {"const": 7},
        "color": {"type": "string", "enum": ["red", "blue"]},
        "day": {"type": "string", "format": "date"}, "short": {"type": "string", "maxLength": 3},
        "free": {"type": "string"}})
    text = x_call("shapes", ("any", "12"), ("one", " true "), ("mixed", "3"), ("mixed_s", " ab"),
                  ("fixed", "7"), ("color", "\t red  "), ("day", " 2024-01-02"), ("short", " ab "),
                  ("free", " ab "))
    [(_, args)] = calls_of(xml().parse(text, [shapes]))
    assert args == {"any": 12, "one": True, "mixed": 3, "mixed_s": "ab", "fixed": 7,
                    "color": "red", "day": "2024-01-02", "short": "ab", "free": " ab "}
    [(_, args)] = calls_of(xml().parse(x_call("shapes", ("any", "twelve")), [shapes]))
    assert args == {"any": "twelve"}


def test_hermes_reads_raw_control_characters_and_returns_them_escaped():
    text = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "a\tb\nc"}}\n</tool_call>'
    [call] = hermes().parse(text, TOOLS).tool_calls
    assert call.arguments == '{"timezone":"a\\tb\\nc"}'
    assert json.loads(call.arguments) == {"timezone": "a\tb\nc"}


def test_calls_separated_by_blank_lines_and_truncated_second_call():
    two = H_ONE + "\n\n  \n" + H_TWO[len(H_ONE) + 1:]
    assert [c.name for c in hermes().parse(two, TOOLS).tool_calls] == ["get_weather", "get_time"]
    cut = H_TWO[:-5]  # the budget ran out inside the second call: all or nothing
    parsed = hermes().parse(cut, TOOLS)
    assert parsed.tool_calls == [] and parsed.content == cut

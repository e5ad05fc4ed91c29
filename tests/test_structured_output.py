"""Constrained decoding end to end: response_format on the offline API and over HTTP.

A tiny random model samples at temperature 1, so whatever it writes is the grammar's
doing: every answer must parse, validate against its schema (jsonschema) and end
with finish_reason "stop". Strings carry maxLength and arrays maxItems so a random
model finishes well within max_tokens.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.errors import InvalidRequestError
from pocketllm.proto.messages import StructuredSpec
from pocketllm.protocol.openai_fields import parse_chat, parse_completion
from pocketllm.protocol.response_format import parse_response_format
from server_process import ServerProcess

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"name": {"type": "string", "maxLength": 6},
                                    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                     "required": ["name", "age"], "additionalProperties": False},
            "active": {"type": "boolean"}},
        "required": ["user", "active"], "additionalProperties": False},
    "array_enum": {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                  "minItems": 1, "maxItems": 3},
                       "size": {"enum": ["S", "M", "L"]}},
        "required": ["colors", "size"], "additionalProperties": False},
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                           {"type": "string", "maxLength": 5},
                                           {"type": "null"}]}},
        "required": ["value"], "additionalProperties": False},
    "formats": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"},
                       "id": {"type": "string", "format": "uuid"},
                       "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["day", "id", "code"], "additionalProperties": False},
}

FORMATS = jsonschema.FormatChecker()
# xgrammar enforces a date's shape, not the calendar (it lets "2024-02-31" through).
FORMATS.checks("date")(lambda v: bool(re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", v)))


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


# ---------------------------------------------------------------- parsing (no engine)


@pytest.mark.parametrize("fmt, spec", [
    (None, None),
    ({"type": "text"}, None),
    ({"type": "json_object"}, StructuredSpec("json_object")),
    ({"type": "regex", "regex": "[0-9]+"}, StructuredSpec("regex", "[0-9]+")),
    ({"type": "grammar", "grammar": 'root ::= "a"'}, StructuredSpec("grammar", 'root ::= "a"')),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}},
     StructuredSpec("json_schema", '{"type": "integer"}')),
])
def test_response_format_shapes(fmt, spec):
    assert parse_response_format(fmt) == spec


@pytest.mark.parametrize("fmt, words", [
    ("json", "must be an object"),
    ({"type": "xml"}, '"type" must be one of'),
    ({"type": "json_object", "schema": {}}, '"schema" is not a field'),
    ({"type": "json_schema"}, 'needs "json_schema"'),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "must be a JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}, "json_schema.extra"),
    ({"type": "regex", "regex": ""}, "non-empty string"),
    ({"type": "grammar"}, "non-empty string"),
])
def test_bad_response_format_shapes_name_the_field(fmt, words):
    for parse in (lambda: parse_chat({"messages": [{"role": "user", "content": "hi"}],
                                      "response_format": fmt}, "r"),
                  lambda: parse_completion({"prompt": "hi", "response_format": fmt}, "r"),
                  lambda: SamplingParams(response_format=fmt)):
        with pytest.raises(InvalidRequestError, match=re.escape(words)) as e:
            parse()
        assert e.value.param == "response_format"


def test_http_parsers_carry_the_spec_to_every_choice():
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "n": 3,
                       "response_format": {"type": "json_object"}}, "r")
    assert [c.sampling.structured for c in chat.choices] == [StructuredSpec("json_object")] * 3
    comp = parse_completion({"prompt": "hi", "response_format": {"type": "regex",
                                                                  "regex": "a|b"}}, "r")
    assert comp.choices[0].sampling.structured == StructuredSpec("regex", "a|b")


def test_grammar_check_names_the_problem_without_a_vocabulary():
    from pocketllm.protocol.grammar_spec import to_grammar

    to_grammar(StructuredSpec("json_schema", json.dumps(SCHEMAS["formats"])))
    for spec, words in [(StructuredSpec("json_schema", '{"type": "frobnicate"}'), "Unsupported type"),
                        (StructuredSpec("json_schema", "{not json"), "invalid json schema"),
                        (StructuredSpec("regex", "(ab"), "parenthesis"),
                        (StructuredSpec("grammar", "root ::= undefined_rule"), "undefined_rule"),
                        (StructuredSpec("structural_tag", '{"type": "nope"}'), "structural tag")]:
        with pytest.raises(ValueError, match=words):
            to_grammar(spec)


def test_json_grammars_keep_strings_valid_json():
    """xgrammar 0.2.9's own length-bounded strings admit raw control characters;
    ours must not, or json.loads refuses the answer."""
    import xgrammar as xgr

    from pocketllm.protocol.grammar_spec import to_grammar

    text = str(to_grammar(StructuredSpec("json_schema", json.dumps(SCHEMAS["nested"]))))
    assert r"[^\"\\\r\n]" not in text and r"\0-\x1f" in text
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([chr(i) for i in range(128)])).compile_grammar(
        to_grammar(StructuredSpec("json_schema", json.dumps(SCHEMAS["nested"]))))
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string('{"user": {"name": "ab')
    assert not matcher.accept_string("\t")


# ---------------------------------------------------------------- worker side


def test_sampler_mask_applies_after_bias_and_logprobs_stay_raw():
    torch = pytest.importorskip("torch")
    import numpy as np

    from pocketllm.proto.messages import SamplingSpec
    from pocketllm.workers.sampler import torch_ops
    from pocketllm.workers.sampler.rules import Sampler, TokenHistory, structured_token_mask

    vocab = 70
    logits = torch.randn(2, vocab)
    logits[1, 5] = 50.0  # row 1's favourite, and forbidden
    raw = logits.clone()
    allowed = [3, 40, 69]
    words = np.zeros((1, 3), dtype=np.uint32)
    for t in allowed:
        words[0, t // 32] |= np.uint32(1 << (t % 32))
    spec = SamplingSpec(temperature=1.0, logprobs=2, logit_bias={5: 100.0})
    plain = SamplingSpec(temperature=0.0)
    mask = structured_token_mask(["b"], words.tobytes(), ["a", "b"])
    histories = [None, TokenHistory(spec, [1], [], vocab)]
    for seed in range(20):
        s = SamplingSpec(**{**{f: getattr(spec, f) for f in spec.__struct_fields__}, "seed": seed})
        out = Sampler(torch_ops, 0)(logits.clone(), [plain, s], [4, 4], histories, mask)
        assert out.token_ids[1] in allowed
        assert out.token_ids[0] == int(raw[0].argmax())  # an unstructured row is untouched
        assert out.logprobs[1].top_token_ids[0] == 5  # from the raw logits
    assert structured_token_mask([], b"", ["a"]) is None
    with pytest.raises(ValueError, match="samples no token"):
        structured_token_mask(["zz"], words.tobytes(), ["a"])
    # a request with drafts: one row per sampled position, in order; never more
    two = np.concatenate([words, words]).tobytes()
    assert structured_token_mask(["b", "b"], two, ["a", "b", "b"])[0].tolist() == [1, 2]
    with pytest.raises(ValueError, match="no more tokens"):
        structured_token_mask(["b", "b"], two, ["a", "b"])


# ---------------------------------------------------------------- offline engine


def test_schemas_sampled_at_temperature_one_always_validate(llm_tiny):
    params, schemas = [], []
    for i, schema in enumerate(SCHEMAS.values()):
        for j in range(4):  # n=4: each choice its own seed and matcher
            params.append(SamplingParams(max_tokens=150, temperature=1.0, seed=10 * i + j,
                                         response_format=json_schema_format(schema)))
            schemas.append(schema)
    outs = llm_tiny.generate(["Answer in JSON:"] * len(params), params)
    for out, schema in zip(outs, schemas):
        assert out.finish_reason == "stop", out.text
        assert_valid(out.text, schema)
    assert len({o.text for o in outs}) > len(SCHEMAS)  # the choices really differ


def test_json_object_regex_and_ebnf(llm_tiny, tiny_llama):
    from tokenizers import Tokenizer

    # An open JSON object never ends by chance: favour '}' and '"' (the grammar still rules).
    tok = Tokenizer.from_file(f"{tiny_llama}/tokenizer.json")
    close = {tok.token_to_id(t): 8.0 for t in ("}", '"', '":')}
    kinds = [({"type": "json_object"}, None),
             ({"type": "regex", "regex": r"[0-9]{3}-[a-z]{2}"}, r"[0-9]{3}-[a-z]{2}"),
             ({"type": "grammar", "grammar": 'root ::= ("yes" | "no") " because " [a-z]{1,5}'},
              r"(yes|no) because [a-z]{1,5}")]
    for fmt, pattern in kinds:
        params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, response_format=fmt,
                                 logit_bias=close if pattern is None else None)
                  for s in range(3)]
        for out in llm_tiny.generate(["Go:"] * 3, params):
            assert out.finish_reason == "stop", (fmt, out.text)
            if pattern is None:
                assert isinstance(json.loads(out.text), dict)
            else:
                assert re.fullmatch(pattern, out.text), (fmt, out.text)


def test_chat_response_format_and_its_errors(llm_tiny):
    msgs = [{"role": "user", "content": "Pick a size."}]
    schema = SCHEMAS["array_enum"]
    out = llm_tiny.chat(msgs, SamplingParams(max_tokens=100, temperature=1.0, seed=1),
                        response_format=json_schema_format(schema))[0]
    assert out.finish_reason == "stop"
    assert_valid(out.text, schema)
    with pytest.raises(InvalidRequestError, match="Unsupported type") as e:
        llm_tiny.chat(msgs, SamplingParams(max_tokens=8), response_format=json_schema_format(
            {"type": "frobnicate"}))
    assert e.value.param == "response_format"
    with pytest.raises(InvalidRequestError, match="given twice"):
        llm_tiny.chat(msgs, SamplingParams(response_format={"type": "json_object"}),
                      response_format={"type": "json_object"})
    assert llm_tiny.generate("still serving", SamplingParams(max_tokens=4))[0].token_ids


def test_compile_timeout_is_a_clean_error_and_the_engine_keeps_going(tiny_llama):
    # ~400 alternatives: about a second to compile here, against a 50 ms limit.
    slow = "(" + "|".join(f"[a-z]{{{i}}}x{i}" for i in range(1, 400)) + ")"
    with LLM(EngineArgs(model=tiny_llama, max_num_batched_tokens=64,
                        structured_output_timeout_s=0.05)) as llm:
        stream = llm.generate_stream("x", SamplingParams(
            max_tokens=8, response_format={"type": "regex", "regex": slow}))
        plain = llm.generate("meanwhile", SamplingParams(max_tokens=6, ignore_eos=True))[0]
        assert plain.finish_reason == "length" and len(plain.token_ids) == 6
        with pytest.raises(InvalidRequestError, match="took longer than 0.05 s") as e:
            list(stream)
        assert e.value.param == "response_format"
        assert llm.generate("after", SamplingParams(max_tokens=3))[0].token_ids


# ---------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess("--model", tiny_llama, "--max-num-batched-tokens", "64")
    yield srv
    srv.stop()


def test_http_chat_n4_json_schema_all_choices_validate(server):
    schema = SCHEMAS["nested"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Who?"}], "n": 4, "temperature": 1.0,
        "seed": 7, "max_tokens": 150, "response_format": json_schema_format(schema)})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4
    for c in choices:
        assert c["finish_reason"] == "stop"
        assert_valid(c["message"]["content"], schema)


def test_http_refusals_and_completions_extension(server):
    url = server.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    for fmt, words in [(json_schema_format({"type": "frobnicate"}), "Unsupported type"),
                       ({"type": "regex", "regex": "(ab"}, "parenthesis"),
                       ({"type": "yaml"}, '"type" must be one of')]:
        r = httpx.post(url, timeout=60, json={"messages": msgs, "response_format": fmt})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "response_format" and words in err["message"]
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": "Code:", "max_tokens": 40, "temperature": 1.0,
        "response_format": {"type": "regex", "regex": "[A-Z]{2}-[0-9]{3}"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", choice["text"]) and choice["finish_reason"] == "stop"

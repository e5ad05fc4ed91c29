"""Hypothesis strategies for fuzzing the HTTP server: request bodies over every field of
/v1/chat/completions and /v1/completions, headers, and raw HTTP bytes.

A body is built from valid values (cheap to serve: a few tokens, a few choices), with a
few fields replaced by boundary or hostile ones. Huge or deep values are drawn as
`Rep`/`Deep`/`Raw` markers with a short repr, so a failing example prints compactly;
`encode()` expands them into the JSON text that is sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import strategies as st

VOCAB = 262144  # the embedded Gemma 3 270M's vocabulary (token ids 0..VOCAB-1)
CHEAP_TOKENS = 4  # max_tokens of a valid example: the CPU decodes ~20 tokens/s
CHEAP_CHOICES = 3


# ------------------------------------------------------------------ markers and encoding


@dataclass(frozen=True)
class Raw:
    """JSON text sent verbatim (numbers Python cannot hold as floats: 1e999, 400 digits)."""
    text: str

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''})"


@dataclass(frozen=True)
class Rep:
    """A string of `unit` repeated `count` times."""
    unit: str
    count: int

    def __repr__(self) -> str:
        return f"Rep({self.unit!r}*{self.count})"


@dataclass(frozen=True)
class Deep:
    """`depth` nested arrays (or objects {"a": ...}) around `leaf`."""
    depth: int
    kind: str = "["  # "[" or "{"

    def __repr__(self) -> str:
        return f"Deep({self.depth}, {self.kind!r})"


@dataclass(frozen=True)
class Many:
    """A list of `count` copies of `item` (e.g. 10,000 stop strings)."""
    item: object
    count: int

    def __repr__(self) -> str:
        return f"Many({self.item!r}*{self.count})"


def encode(obj) -> str:
    """JSON text for obj: lone surrogates as \\ud800 escapes (ensure_ascii), NaN and
    Infinity as Python writes them (a hostile extension), markers expanded."""
    if isinstance(obj, Raw):
        return obj.text
    if isinstance(obj, Rep):
        return json.dumps(obj.unit * obj.count)
    if isinstance(obj, Deep):
        if obj.kind == "[":
            return "[" * obj.depth + "]" * obj.depth
        return '{"a":' * obj.depth + "1" + "}" * obj.depth
    if isinstance(obj, Many):
        return "[" + ",".join([encode(obj.item)] * obj.count) + "]"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{encode(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(encode(v) for v in obj) + "]"
    return json.dumps(obj)  # str, int (any size), float (NaN/Infinity), bool, None


def expand(obj):
    """The Python value a marker stands for (for computing what a valid answer holds);
    Raw and Deep stay markers (no server should take them for a valid value)."""
    if isinstance(obj, Rep):
        return obj.unit * obj.count
    if isinstance(obj, Many):
        return [expand(obj.item)] * obj.count
    if isinstance(obj, dict):
        return {k: expand(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [expand(v) for v in obj]
    return obj


# ------------------------------------------------------------------ generic values

# Text a client could send: plain, then odd (NUL, RTL override, BOM, lone surrogates, noncharacters)
plain_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=12)
odd_chars = st.sampled_from(["\x00", "\u202e", "\u200f", "\ufeff", "\ud800", "\udfff",
                             "\uffff", "\U0010ffff", "\u0301", "\r\n", "\x1b[31m", "🙂", "ｱ",
                             "{{", "}}", "{%", "<end_of_turn>", "<start_of_turn>", "<bos>",
                             "<eos>", "\\", '"'])
odd_text = st.lists(st.one_of(plain_text, odd_chars), min_size=1, max_size=5).map("".join)
any_text = st.one_of(plain_text, odd_text, st.text(max_size=20))
huge_text = st.sampled_from([Rep("x", 1 << 20), Rep("ab ", 300_000), Rep("\ud800", 5000),
                             Rep("\x00", 100_000), Rep("🙂", 100_000)])

huge_ints = st.sampled_from([2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1,
                             10**30, -2**63, -2**63 - 1, -2**64, -(10**30), 10**6, 10**9])
raw_numbers = st.sampled_from([Raw("1e999"), Raw("-1e999"), Raw("1E400"), Raw("1e-999"),
                               Raw("1" + "0" * 400), Raw("-" + "9" * 400), Raw("0.5e1"),
                               Raw("1.0"), Raw("-0"), Raw("NaN"), Raw("Infinity"),
                               Raw("-Infinity"), Raw("4" * 5000)])
odd_floats = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -1e308,
                              5e-324, -0.0, 2.0000001, -2.0000001, 1e-30])
wrong_types = st.sampled_from(["", "1", "abc", [], {}, [1, "a"], {"a": 1}, True, False,
                               None, [None], [[1]], 0.5])
deep = st.sampled_from([Deep(10_000, "["), Deep(10_000, "{"), Deep(200, "["), Deep(2000, "{")])

hostile = st.one_of(huge_ints, raw_numbers, odd_floats, wrong_types, any_text, deep,
                    huge_text, st.integers(-5, -1))


# ------------------------------------------------------------------ per-field values

def small(lo: int, hi: int):
    return st.integers(lo, hi)


token_id = st.integers(0, VOCAB - 1)
bad_token_id = st.one_of(st.sampled_from([VOCAB, VOCAB + 1, -1, 2**31, 2**63, 2**64, 10**30]),
                         huge_ints)
unit = st.floats(0, 1, allow_nan=False)

stop_value = st.one_of(any_text, st.lists(any_text, max_size=4))
schema_leaf = st.sampled_from([{"type": "string", "maxLength": 3}, {"type": "integer"},
                               {"type": "boolean"}, {"enum": ["a", "b"]}])
small_schema = st.builds(lambda props: {"type": "object", "properties": props,
                                        "required": sorted(props)},
                         st.dictionaries(st.sampled_from("abc"), schema_leaf, max_size=2))


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string", "maxLength": 2}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


response_format_valid = st.one_of(
    st.just({"type": "text"}), st.just({"type": "json_object"}),
    small_schema.map(lambda s: {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": s, "strict": True}}),
    st.sampled_from(["[a-z]{1,3}", "(yes|no)", "[0-9]+"]).map(
        lambda r: {"type": "regex", "regex": r}),
    st.sampled_from(['root ::= "yes" | "no"', 'root ::= [a-c]+']).map(
        lambda g: {"type": "grammar", "grammar": g}))
response_format_hostile = st.one_of(
    st.sampled_from([{"type": "regex", "regex": "[^\\s\\S]"}, {"type": "regex", "regex": "a{0}"},
                     {"type": "regex", "regex": "("}, {"type": "regex", "regex": "a{99999}"},
                     {"type": "grammar", "grammar": "root ::= root"},
                     {"type": "grammar", "grammar": 'root ::= ""'},
                     {"type": "grammar", "grammar": "root ::= [^\\x00-\\U0010ffff]"},
                     {"type": "grammar", "grammar": "nonsense"},
                     {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                         "type": "string", "minLength": 5, "maxLength": 2}}},
                     {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                         "$ref": "#/definitions/nope"}}},
                     {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                         "type": "string", "pattern": "("}}},
                     {"type": "json_object", "extra": 1}, {"type": "nope"}, {}]),
    st.sampled_from([20, 100, 900]).map(lambda d: {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": nested_schema(d)}}),
    st.builds(lambda v: {"type": "json_schema", "json_schema": {"name": "x", "schema": v}},
              hostile),
    st.builds(lambda v: {"type": "regex", "regex": v}, hostile),
    st.builds(lambda v: {"type": "grammar", "grammar": v}, hostile))

tool = st.builds(lambda name, params: {"type": "function", "function": {
    "name": name, "description": "d", "parameters": params}},
    st.sampled_from(["get_weather", "f", "a-b_c"]),
    st.one_of(st.just({"type": "object", "properties": {"city": {"type": "string"}}}),
              small_schema))
tool_choice_valid = st.one_of(st.sampled_from(["none", "auto", "required"]),
                              st.just({"type": "function", "function": {"name": "f"}}))

message = st.one_of(
    st.builds(lambda role, content: {"role": role, "content": content},
              st.sampled_from(["user", "system", "developer", "assistant"]),
              st.one_of(plain_text, st.lists(plain_text, min_size=1, max_size=2).map(
                  lambda ts: [{"type": "text", "text": t} for t in ts]))),
    st.just({"role": "tool", "content": "42", "tool_call_id": "call_1"}),
    st.just({"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}))
messages_valid = st.lists(message, min_size=1, max_size=3).map(
    lambda ms: ms if ms[-1]["role"] == "user" else ms + [{"role": "user", "content": "Hi"}])
message_hostile = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, st.one_of(odd_text, huge_text, hostile)),
    st.builds(lambda r: {"role": r, "content": "hi"}, hostile),
    st.just({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
    st.just({"role": "tool", "content": "x"}),
    st.just({"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "[1"}}]}),
    st.just({"role": "user"}), st.just({"role": "user", "content": "hi", "name": Deep(500)}))
messages_hostile = st.one_of(
    hostile, st.just([]), st.lists(message_hostile, min_size=1, max_size=2),
    st.just(Many({"role": "user", "content": "hi"}, 20_000)))

template_kwargs_hostile = st.one_of(
    st.dictionaries(st.sampled_from(["bos_token", "eos_token", "messages", "add_generation_prompt",
                                     "tools", "tool_choice", "raise_exception", "range",
                                     "namespace", "enable_thinking", "reasoning_effort",
                                     "__class__", "loop", "strftime_now"]),
                    hostile, min_size=1, max_size=2),
    hostile)

prompt_valid = st.one_of(plain_text, st.lists(plain_text, min_size=1, max_size=2),
                         st.lists(token_id, min_size=1, max_size=6),
                         st.lists(st.lists(token_id, min_size=1, max_size=4), min_size=1,
                                  max_size=2))
prompt_hostile = st.one_of(
    hostile, st.just(""), st.just([]), st.just([[]]), st.just([""]),
    st.lists(bad_token_id, min_size=1, max_size=2), st.just(Many(1, 40_000)),
    st.lists(st.one_of(odd_text, huge_text), min_size=1, max_size=2),
    st.just(Many("a", 200)))


def logit_bias(keys, values, max_size=4):
    return st.dictionaries(keys, values, max_size=max_size)


logit_bias_valid = logit_bias(token_id.map(str), st.floats(-100, 100))
logit_bias_hostile = st.one_of(
    logit_bias(bad_token_id.map(str), st.floats(-100, 100), 2),
    logit_bias(st.sampled_from(["-1", "1.5", "", " 1", "٣", "0x10", "1e3", "1" * 30]),
               st.just(1), 2),
    logit_bias(token_id.map(str), st.one_of(odd_floats, raw_numbers, wrong_types), 2),
    st.just({str(i): 1 for i in range(301)}), hostile)

# field -> (valid values, field-specific hostile values); `hostile` is added to every field
COMMON = {
    "max_tokens": (small(1, CHEAP_TOKENS), st.sampled_from([0, -1, 2**63, 2**64, 10**6])),
    "temperature": (st.one_of(st.just(0), st.floats(0, 2)), odd_floats),
    "top_p": (st.floats(0.01, 1), st.sampled_from([0, 1.0000001, -1])),
    "top_k": (small(-1, 100), st.sampled_from([-2, VOCAB, VOCAB + 1, 2**31, 2**63, 2**64])),
    "min_p": (unit, st.sampled_from([-0.1, 1.1])),
    "seed": (st.integers(0, 2**63 - 1), st.sampled_from([-1, 2**63, 2**64, -2**63 - 1])),
    "stream": (st.booleans(), wrong_types),
    "stream_options": (st.builds(lambda b: {"include_usage": b}, st.booleans()),
                       st.sampled_from([{"x": 1}, {"include_usage": "yes"}])),
    "n": (small(1, CHEAP_CHOICES), st.sampled_from([0, 129, 2**64])),
    "stop": (stop_value, st.one_of(huge_text, st.just(Many("a", 10_000)),
                                   st.just(Many("\ud800", 100)), st.just([""]))),
    "ignore_eos": (st.booleans(), wrong_types),
    "stop_token_ids": (st.lists(token_id, max_size=4),
                       st.lists(bad_token_id, min_size=1, max_size=2)),
    "skip_special_tokens": (st.booleans(), wrong_types),
    "frequency_penalty": (st.floats(-2, 2), odd_floats),
    "presence_penalty": (st.floats(-2, 2), odd_floats),
    "repetition_penalty": (st.floats(0.5, 2), st.sampled_from([0, -1, 1e308])),
    "logit_bias": (logit_bias_valid, logit_bias_hostile),
    "request_id": (st.uuids().map(lambda u: "fz-" + u.hex),
                   st.one_of(st.just(""), st.just(Rep("r", 201)), odd_text)),
    "response_format": (response_format_valid, response_format_hostile),
    # inert fields
    "model": (st.just("gemma-3-270m-q4_k_m"), any_text),
    "user": (plain_text, huge_text),
    "store": (st.booleans(), wrong_types),
    "metadata": (st.dictionaries(plain_text, plain_text, max_size=2), deep),
    "service_tier": (st.just("auto"), any_text),
}
CHAT = {
    **COMMON,
    "messages": (messages_valid, messages_hostile),
    "max_completion_tokens": COMMON["max_tokens"],
    "logprobs": (st.booleans(), st.sampled_from([1, 5, "true"])),
    "top_logprobs": (small(0, 5), st.sampled_from([-1, 21, 2**64])),
    "tools": (st.lists(tool, min_size=1, max_size=2),
              st.one_of(st.just(Many({"type": "function", "function": {"name": "f"}}, 5000)),
                        st.lists(hostile, min_size=1, max_size=2))),
    "tool_choice": (tool_choice_valid, st.just({"type": "function", "function": {"name": "nope"}})),
    "parallel_tool_calls": (st.booleans(), wrong_types),
    "thinking_mode": (st.booleans(), wrong_types),
    "reasoning_effort": (st.sampled_from(["low", "medium", "high"]), any_text),
    "add_generation_prompt": (st.booleans(), wrong_types),
    "drop_thinking": (st.booleans(), wrong_types),
    "chat_template_kwargs": (st.one_of(st.just({}), st.just({"custom_flag": True})),
                             template_kwargs_hostile),
}
COMPLETION = {
    **COMMON,
    "prompt": (prompt_valid, prompt_hostile),
    "best_of": (small(1, CHEAP_CHOICES), st.sampled_from([0, 129, 2**64])),
    "suffix": (st.sampled_from(["", None]), any_text),
    "echo": (st.booleans(), wrong_types),
    "logprobs": (small(0, 5), st.sampled_from([-1, 21, True, 2**64])),
    "top_logprobs": (st.just(None), st.sampled_from([1, 0])),
}


@st.composite
def body(draw, fields: dict, required: tuple[str, ...]):
    """A request body: the required fields and a few optional ones at valid values, then
    0..2 fields (or unknown ones) at hostile values, and sometimes a required one dropped."""
    out = {name: draw(fields[name][0]) for name in required}
    out.setdefault("max_tokens", draw(fields["max_tokens"][0]))  # keep valid examples cheap
    names = sorted(fields)
    for name in draw(st.lists(st.sampled_from(names), max_size=6, unique=True)):
        out[name] = draw(fields[name][0])
    for name in draw(st.lists(st.sampled_from(names + ["unknown_field", "__proto__", ""]),
                              max_size=2, unique=True)):
        extra = fields[name][1] if name in fields else hostile
        out[name] = draw(st.one_of(extra, hostile) if name in fields else extra)
    for name in required:
        if draw(st.integers(0, 19)) == 0:
            out.pop(name, None)
    return out


chat_bodies = body(CHAT, ("messages",))
completion_bodies = body(COMPLETION, ("prompt",))

# ------------------------------------------------------------------ headers

# A header value as a client can send it: HTTP strips the whitespace around a value, and
# httpx (h11) refuses to send a value that has any (raw_requests sends such bytes).
ascii_value = st.text(st.characters(min_codepoint=32, max_codepoint=126),
                      max_size=60).map(str.strip)
headers = st.fixed_dictionaries({}, optional={
    "X-Request-Id": st.one_of(ascii_value, st.sampled_from(["a" * 10_000, "a" * 201, "", "%00"])),
    "Content-Type": st.sampled_from(["application/json", "text/plain", "application/json; "
                                     "charset=latin-1", "multipart/form-data; boundary=x",
                                     "application/x-www-form-urlencoded", "*/*", "", ";;;",
                                     "application/json; charset=utf-16"]),
    "Authorization": st.one_of(ascii_value, st.just("Bearer " + "k" * 6000)),
    "Accept": st.sampled_from(["text/event-stream", "application/xml", "*/*", ""]),
    "Content-Encoding": st.sampled_from(["gzip", "deflate", "br", "identity", "x-nope"]),
    "Expect": st.sampled_from(["100-continue", "nope"]),
})

# ------------------------------------------------------------------ raw HTTP

PATHS = ["/v1/chat/completions", "/v1/completions"]
raw_bodies = st.sampled_from([
    b"", b"{", b'{"prompt": "hi"', b"null", b"[]", b"1", b'"x"', b"NaN", b"\xff\xfe\x00",
    b"\xef\xbb\xbf{\"prompt\": \"hi\", \"max_tokens\": 1}",
    '{"prompt": "hi", "max_tokens": 1}'.encode("utf-16"),
    b'{"prompt": "\xc3\x28", "max_tokens": 1}', b'{"prompt": "\\ud800", "max_tokens": 1}',
    b'{"prompt": "hi", "prompt": 5}', b'{"max_tokens": 1, "prompt": "a\\u0000b"}',
    b"[" * 100_000, b'{"a":' * 50_000, b"{" + b" " * 1_000_000 + b"}",
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}',
])


@st.composite
def raw_requests(draw) -> bytes:
    """One HTTP/1.1 request as bytes: odd methods, paths, header lines and bodies."""
    method = draw(st.sampled_from([b"POST", b"POST", b"GET", b"PUT", b"OPTIONS", b"BREW",
                                   b"post", b"POST "]))
    path = draw(st.sampled_from([p.encode() for p in PATHS] + [
        b"/v1/completions?x=%ff", b"/%ff%fe", b"/v1/requests/" + b"a" * 5000, b"*",
        b"/v1/../v1/completions", b"/" + b"x" * 20_000]))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0",
                                    b"HTTP/9"]))
    payload = draw(raw_bodies)
    lines = [b"Host: 127.0.0.1", b"Connection: close"]
    length = draw(st.sampled_from([b"ok", b"ok", b"ok", b"none", b"abc", b"-1", b"dup"]))
    if length == b"ok":
        lines.append(b"Content-Length: %d" % len(payload))
    elif length == b"dup":
        lines += [b"Content-Length: %d" % len(payload), b"Content-Length: 1"]
    elif length != b"none":
        lines.append(b"Content-Length: " + length)
    lines += draw(st.lists(st.sampled_from([
        b"Content-Type: application/json", b"X-Request-Id: " + b"i" * 10_000,
        b"X-Request-Id: \xff\xfe", b"X-Big: " + b"h" * 100_000, b"Bad Header: x",
        b"NoColon", b"X-Nul: a\x00b", b" Folded: x", b"Transfer-Encoding: chunked",
        b"Transfer-Encoding: gzip, chunked", b"Content-Encoding: gzip",
        b"Authorization: \xff", b"Expect: 100-continue"]), max_size=3, unique=True))
    lines += [b"X-Filler-%d: y" % i for i in range(draw(st.sampled_from([0, 0, 200])))]
    return b"%s %s %s\r\n%s\r\n\r\n%s" % (method, path, version, b"\r\n".join(lines), payload)

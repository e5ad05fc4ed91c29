"""The limits a request is checked against once, at the edge (HTTP and the offline API).

The stages assume what is checked here: integers fit 64 bits (msgspec and the
worker's tensors), token ids are inside the vocabulary (grammar bitmasks, the
sampler), strings encode as UTF-8, structures are shallow enough to recurse
over, and no single field can make a stage's work explode (the stop matcher
keeps every prefix of every stop string; a deep schema compiles for seconds).
Every number is documented in docs/api.md ("Limits"); the ones a deployment may
want to change are fields of RequestLimits (EngineArgs and a CLI flag each).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from ..errors import InvalidRequestError, PromptTooLongError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# request_id (body field or X-Request-Id header): it names the request in headers, logs and
# the DELETE /v1/requests/<id> path, so only characters that are safe in all three.
MAX_REQUEST_ID_CHARS = 200
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@+=~-]+")
MAX_STOP_STRING_CHARS = 1024  # each stop string (the matcher holds all its prefixes)
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 4096
MAX_TOOLS = 128  # OpenAI's own cap
MAX_TOOLS_BYTES = 128 << 10  # the tools array as JSON
MAX_SCHEMA_BYTES = 64 << 10  # a response_format schema (as JSON), regex or grammar
MAX_SCHEMA_DEPTH = 32  # nesting of a response_format schema or a tool's parameters
MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs entries
MAX_TEMPLATE_KWARGS_BYTES = 16 << 10  # chat_template_kwargs as JSON
MAX_TEMPLATE_KWARG_DEPTH = 4  # a value may be a small structure, not a document
# HTTP framing (aiohttp's parser): request line and each header line, and header count.
MAX_HTTP_LINE_BYTES = 8190
MAX_HTTP_HEADERS = 128

# chat_template_kwargs keys that would replace what the engine passes to the template
# (ChatRenderer.render's arguments, the tokenizer's special tokens, Jinja's and our
# globals) or what the tokenizer stage reads as its own options.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "add_generation_prompt", "tools", "tool_choice", "parallel_tool_calls",
    "drop_thinking", "raise_exception", "range", "dict", "lipsum", "cycler", "joiner",
    "namespace"})
_TEMPLATE_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


@dataclass(frozen=True)
class RequestLimits:
    """What one request may hold. The first four are deployment settings (EngineArgs);
    vocab_size and max_model_len are the model's bounds, None until it is known."""

    max_stop_strings: int = 32
    max_stop_bytes: int = 4096  # all stop strings together, UTF-8
    max_prompt_chars: int = 1_000_000  # a request's prompt text (all prompts, all messages)
    max_json_depth: int = 64  # nesting of the request body (and of offline structures)
    vocab_size: Optional[int] = None
    max_model_len: Optional[int] = None

    @classmethod
    def from_args(cls, args: Any) -> "RequestLimits":
        return cls(**{f: getattr(args, f) for f in SETTINGS})

    def for_model(self, vocab_size: int, max_model_len: int) -> "RequestLimits":
        return dataclasses.replace(self, vocab_size=vocab_size, max_model_len=max_model_len)


SETTINGS = ("max_stop_strings", "max_stop_bytes", "max_prompt_chars", "max_json_depth")
DEFAULT_LIMITS = RequestLimits()
# Only the fixed limits: what constructing a SamplingParams checks (the engine it is sent to
# checks its own settings, which may be above the defaults).
FIXED_LIMITS = RequestLimits(**{f: INT64_MAX for f in SETTINGS})


def validate_settings(values: dict) -> None:
    """EngineArgs' check of its limit fields."""
    for name in SETTINGS:
        v = values[name]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InvalidRequestError(f"{name} must be a positive integer", name)


# ---------------------------------------------------------------- numbers


def at_most(param: str, count: int, limit: int, what: str, unit: str) -> None:
    """Refuse a count over its limit, e.g. '"tools" has 200 entries; at most 128 are allowed'
    (``what``: '"tools" has', ``unit``: "entries")."""
    if count > limit:
        raise InvalidRequestError(f"{what} {count} {unit}; at most {limit} are allowed", param)


def shown(value: Any) -> str:
    """A value for an error message: short, and never a 4300-digit integer (str() refuses)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10 ** 30 else \
        f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 60 else text[:57] + "..."


def check_int(param: str, value: int, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    if not lo <= value <= hi:
        raise InvalidRequestError(f'"{param}" = {shown(value)} is out of range: it must be in '
                                  f"{lo}..{hi}", param)
    return value


def check_token_ids(param: str, ids: Iterable[int], limits: RequestLimits,
                    what: str = "token id") -> None:
    """Each id in 0..vocab_size-1 (0..INT64_MAX while the vocabulary is unknown)."""
    hi = INT64_MAX if limits.vocab_size is None else limits.vocab_size - 1
    for t in ids:
        if not 0 <= t <= hi:
            where = "outside the vocabulary" if limits.vocab_size is not None else "out of range"
            raise InvalidRequestError(f"{what} {shown(t)} in \"{param}\" is {where} "
                                      f"(0..{hi})", param)


def check_max_tokens(param: str, value: int, limits: RequestLimits) -> None:
    check_int(param, value, 1)
    if limits.max_model_len is not None and value > limits.max_model_len:
        raise InvalidRequestError(
            f'"{param}" = {shown(value)} is more than this model\'s context (max_model_len = '
            f"{limits.max_model_len}); ask for at most that many tokens", param)


def check_prompt_ids(ids: list, limits: RequestLimits) -> None:
    check_token_ids("prompt", ids, limits, "prompt token id")
    if limits.max_model_len is not None and len(ids) >= limits.max_model_len:
        raise PromptTooLongError(
            f"the prompt is {len(ids)} tokens; this engine's max_model_len is "
            f"{limits.max_model_len}, which must also leave room for at least one generated "
            "token", "prompt")


# ---------------------------------------------------------------- text


def has_lone_surrogate(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _lone_surrogate(param: str, where: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-"
                               "\\udfff escape), which is not text; send valid Unicode", param)


def check_text(param: str, s: str) -> None:
    if has_lone_surrogate(s):
        raise _lone_surrogate(param, f'"{param}"')


def check_stop(stop: Any, limits: RequestLimits) -> None:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    at_most("stop", len(stops), limits.max_stop_strings, '"stop" has', "strings")
    total = 0
    for s in stops:
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(f"a stop string of {len(s)} characters is over the limit "
                                      f"of {MAX_STOP_STRING_CHARS}", "stop")
        check_text("stop", s)
        total += len(s.encode("utf-8"))
    at_most("stop", total, limits.max_stop_bytes, "the stop strings are", "bytes together")


def check_prompt_chars(count: int, limits: RequestLimits, param: str) -> None:
    if count > limits.max_prompt_chars:
        raise PromptTooLongError(f"the prompt text is {count} characters; this server takes at "
                                 f"most {limits.max_prompt_chars} per request", param)


def check_request_id(rid: Any) -> str:
    if not isinstance(rid, str) or not 1 <= len(rid) <= MAX_REQUEST_ID_CHARS or \
            not _REQUEST_ID.fullmatch(rid):
        raise InvalidRequestError(
            f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} characters of A-Z, a-z, 0-9 and "
            "._:@+=~-", "request_id")
    return rid


# ---------------------------------------------------------------- structures

_SCALARS = frozenset({int, float, bool, type(None)})
_TEXT_SCALARS = _SCALARS | {str}
_SEQUENCES = (list, tuple)
_CONTAINERS = (dict, list, tuple)


def check_structure(value: Any, max_depth: int, param: Optional[str] = None,
                    strings: bool = True, what: str = "the request body") -> int:
    """Refuse nesting deeper than max_depth and (strings) lone surrogates in any string or
    key, without recursion. param None: value is the body, and the param named is the
    top-level key a problem sits under. Returns the depth (a scalar is 0)."""
    deepest = 0
    stack = [(value, 1, param)]
    while stack:
        node, depth, field = stack.pop()
        if isinstance(node, str):
            if has_lone_surrogate(node):
                raise _lone_surrogate(field, f'a string in "{field}"' if field else what)
            continue
        if isinstance(node, dict):
            items: Iterable = node.items()
            if strings:
                for k in node:
                    if isinstance(k, str) and has_lone_surrogate(k):
                        raise _lone_surrogate(field, f'a key in "{field}"' if field
                                              else "a key of the request body")
        elif isinstance(node, _SEQUENCES):
            kinds = set(map(type, node))
            flat = kinds <= _SCALARS or (not strings and kinds <= _TEXT_SCALARS)
            items = () if flat else enumerate(node)  # flat (token ids...): nothing below
        else:
            continue
        if depth > deepest:
            deepest = depth
            if depth > max_depth:
                raise InvalidRequestError(
                    f"{what} is nested more than {max_depth} levels deep" +
                    (f' (in "{field}")' if field and param is None else ""), field)
        for k, v in items:
            if isinstance(v, _CONTAINERS) or (strings and isinstance(v, str)):
                stack.append((v, depth + 1, field if field is not None else k))
    return deepest


def json_size(param: str, value: Any) -> int:
    """UTF-8 bytes of value as compact JSON (a non-JSON value is refused)."""
    try:
        return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False).encode("utf-8"))
    except (TypeError, ValueError, UnicodeEncodeError, RecursionError):
        raise InvalidRequestError(f'"{param}" must hold JSON values only (objects, arrays, '
                                  "strings, finite numbers, booleans, null)", param) from None


def check_schema(param: str, schema: Any) -> None:
    """A response_format schema or a tool's parameters: depth and size."""
    check_structure(schema, MAX_SCHEMA_DEPTH, param, what=f'the schema in "{param}"')
    at_most(param, json_size(param, schema), MAX_SCHEMA_BYTES, f'the schema in "{param}" is',
            "bytes as JSON")


def check_grammar_text(param: str, kind: str, text: str) -> None:
    check_text(param, text)
    at_most(param, len(text), MAX_SCHEMA_BYTES, f"the {kind} is", "characters")


def check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        return  # its shape is tool_parsers.tool_schemas' check
    at_most("tools", len(tools), MAX_TOOLS, '"tools" has', "entries")
    check_structure(tools, MAX_SCHEMA_DEPTH + 3, "tools", what='"tools"')  # tools[i].function
    at_most("tools", json_size("tools", tools), MAX_TOOLS_BYTES, '"tools" is', "bytes as JSON")


def check_messages(messages: Any, limits: RequestLimits) -> None:
    """Before normalization (which copies them): the count."""
    if isinstance(messages, _SEQUENCES):
        at_most("messages", len(messages), MAX_MESSAGES, '"messages" has', "entries")


def check_message_chars(messages: list[dict], limits: RequestLimits) -> None:
    """After normalization (content is a string): the prompt text's size."""
    check_prompt_chars(sum(len(m["content"]) for m in messages), limits, "messages")


def check_template_kwargs(kwargs: Optional[dict]) -> None:
    """Only new template variables, each a JSON scalar or a small structure."""
    if not kwargs:
        return
    param = "chat_template_kwargs"
    at_most(param, len(kwargs), MAX_TEMPLATE_KWARGS, f'"{param}" has', "entries")
    for key in kwargs:
        if not isinstance(key, str) or not _TEMPLATE_KWARG_NAME.fullmatch(key):
            raise InvalidRequestError(f'"{param}" key {shown(key)} is not a template variable '
                                      "name (a letter or _, then letters, digits or _; at most "
                                      "64)", param)
        if key in RESERVED_TEMPLATE_KWARGS or key.endswith("_token"):
            raise InvalidRequestError(
                f'"{param}" may not set {key!r}: the engine passes that to the template itself '
                "(the messages, tools, generation prompt and special tokens come from the "
                "request's own fields and the checkpoint)", param)
    check_structure(kwargs, MAX_TEMPLATE_KWARG_DEPTH + 1, param, what=f'"{param}"')
    at_most(param, json_size(param, kwargs), MAX_TEMPLATE_KWARGS_BYTES, f'"{param}" is',
            "bytes as JSON")


# ---------------------------------------------------------------- the HTTP body

# Only a \uD800-\uDFFF escape can put a surrogate into a string decoded from UTF-8 text.
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text[:40]} is too large for a 64-bit float")
    return value


def parse_body(raw: bytes, limits: RequestLimits) -> dict:
    """The request body as a JSON object, or a 400: UTF-8, strict JSON (no NaN/Infinity,
    finite numbers), at most max_json_depth deep, no lone surrogate in any string."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError("the request body is not valid UTF-8") from None
    try:
        body = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:  # far deeper than any limit; json's C parser gave up
        raise InvalidRequestError(f"the request body is nested more than "
                                  f"{limits.max_json_depth} levels deep") from None
    except ValueError as e:
        raise InvalidRequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    check_structure(body, limits.max_json_depth, strings=bool(_ESCAPED_SURROGATE.search(text)))
    return body

"""``response_format``: the one parser the HTTP server and the offline API share.

OpenAI's shapes, plus two PocketLLM extensions:

    {"type": "text"}                                   -> None (unconstrained)
    {"type": "json_object"}                            -> any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
    {"type": "regex", "regex": "..."}                  (extension)
    {"type": "grammar", "grammar": "..."}              (extension: xgrammar EBNF / GBNF)

Only the shape and the size limits (protocol/limits.py) are checked here; whether
the schema, pattern or grammar compiles is the tokenizer stage's check (it needs
xgrammar). Every refusal names "response_format".
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ..errors import InvalidRequestError
from ..proto.messages import StructuredSpec
from .limits import check_grammar_text, check_schema

PARAM = "response_format"
TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def _bad(why: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid response_format: {why}", PARAM)


def parse_response_format(fmt: Any) -> Optional[StructuredSpec]:
    """The grammar a ``response_format`` asks for (None: plain text), or a 400."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad(f'it must be an object such as {{"type": "json_object"}}, not '
                   f"{type(fmt).__name__}")
    kind = fmt.get("type")
    if kind not in TYPES:
        raise _bad(f'"type" must be one of {", ".join(TYPES)}, not {kind!r}')
    allowed = {"type", "json_schema"} if kind == "json_schema" else (
        {"type", kind} if kind in ("regex", "grammar") else {"type"})
    extra = sorted(set(fmt) - allowed)
    if extra:
        raise _bad(f'"{extra[0]}" is not a field of the {kind!r} format')
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object")
    if kind in ("regex", "grammar"):
        value = fmt.get(kind)
        if not isinstance(value, str) or not value:
            raise _bad(f'the {kind!r} format needs "{kind}": a non-empty string')
        check_grammar_text(PARAM, kind, value)
        return StructuredSpec(kind, value)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad('the "json_schema" format needs "json_schema": {"name": ..., "schema": {...}}')
    extra = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if extra:
        raise _bad(f'"json_schema.{extra[0]}" is not a field; known: '
                   f"{', '.join(sorted(_JSON_SCHEMA_KEYS))}")
    for key, typ, what in (("name", str, "a string"), ("description", str, "a string"),
                           ("strict", bool, "a boolean")):
        if spec.get(key) is not None and not isinstance(spec[key], typ):
            raise _bad(f'"json_schema.{key}" must be {what}')
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _bad('"json_schema.schema" must be a JSON Schema object (the shape the answer '
                   "must take)")
    check_schema(PARAM, schema)  # size and depth: a deep schema compiles for seconds
    # "strict" is accepted either way: the schema is always enforced (docs/api.md).
    return StructuredSpec("json_schema", json.dumps(schema))  # key order = property order

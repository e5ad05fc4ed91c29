"""XML calls, as the templates of Qwen3-Coder and the qwen3_5 family write them:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The syntax records no types (`3` and `three` are both just characters), so each
value is read back against the type the request's own
tools[].function.parameters.properties[ARG].type declares:

  string          the text verbatim
  integer         a JSON integer literal (`3`, `-12`; not `03`, `3.0`, `+3`) -> number
  number          a JSON number literal -> number (int when it has no fraction/exponent)
  boolean         `true` / `false`, case-sensitive -> true / false
  object / array  JSON that parses to that kind -> that value
  null            `null` -> null
  anything else   (missing, unknown, or the text does not read as the declared
                  type) -> the text verbatim, a string

Before typing, exactly one leading and one trailing newline are removed: the
template writes them around every value. Non-string types also ignore
surrounding whitespace, as JSON does. A list of types (["integer", "null"]) is
tried in order, skipping "string"; the first that reads the text wins, else
the text stays a string. A schema without "type" takes the types of its
anyOf/oneOf alternatives, in order. An untyped enum/const (["a", 3]) gives the
listed value the text spells as JSON. A string whose schema constrains its
text (enum, const, pattern, format, minLength, maxLength) loses surrounding
whitespace: that is the value the tool_choice grammar (xgrammar's qwen_xml
style) checked; an unconstrained string stays verbatim. With no tools at all,
every argument stays a string: nothing settles whether `01234` meant a number.

Values end at the first `</parameter>`; a value that itself contains that
text cannot be told from the end of the value, and what follows then fails
the parse as malformed. Duplicate parameters are malformed too.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any, Callable

from .base import (CALL_CLOSE, CALL_OPEN, FramedToolParser, MalformedCall, ToolSchemas, expect,
                   loads_strict, skip_whitespace)

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"

_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NOT_A_VALUE = object()  # a converter's "does not read as this type"
# String constraints xgrammar checks on the value without surrounding whitespace.
_CHECKED_STRING = ("enum", "const", "pattern", "format", "minLength", "maxLength")


def _as_integer(text: str) -> Any:
    text = text.strip()
    if not _INTEGER.fullmatch(text):
        return _NOT_A_VALUE
    try:
        return int(text)
    except ValueError:  # past Python's digit limit for int(str)
        return _NOT_A_VALUE


def _as_number(text: str) -> Any:
    text = text.strip()
    if _INTEGER.fullmatch(text):
        return _as_integer(text)
    if _NUMBER.fullmatch(text):
        value = float(text)
        return value if math.isfinite(value) else _NOT_A_VALUE  # 1e999 has no JSON spelling
    return _NOT_A_VALUE


def _as_boolean(text: str) -> Any:
    return {"true": True, "false": False}.get(text.strip(), _NOT_A_VALUE)


def _as_null(text: str) -> Any:
    return None if text.strip() == "null" else _NOT_A_VALUE


def _as_json_of(kind: type) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = loads_strict(text)
        except ValueError:
            return _NOT_A_VALUE
        return value if isinstance(value, kind) else _NOT_A_VALUE
    return convert


CONVERTERS: dict[str, Callable[[str], Any]] = {
    "integer": _as_integer, "number": _as_number, "boolean": _as_boolean, "null": _as_null,
    "object": _as_json_of(dict), "array": _as_json_of(list),
}


def _declared_kinds(schema: dict) -> list:
    """The schema's types in order; without "type", those of its anyOf/oneOf alternatives."""
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return declared
    kinds: list = []
    for key in ("anyOf", "oneOf"):
        for alt in schema.get(key) or []:
            if isinstance(alt, dict):
                kinds += [k for k in _declared_kinds(alt) if k not in kinds]
    return kinds


def typed_value(text: str, schema: Any) -> Any:
    """Read one parameter's text as its declared type; the text itself when it does not read."""
    if not isinstance(schema, dict):
        return text
    for kind in _declared_kinds(schema):
        convert = CONVERTERS.get(kind) if isinstance(kind, str) else None
        if convert is not None:
            value = convert(text)
            if value is not _NOT_A_VALUE:
                return value
    choices = schema["enum"] if isinstance(schema.get("enum"), list) else \
        [schema["const"]] if "const" in schema else None
    if choices is not None:  # an untyped enum of mixed values: the value the text spells
        with contextlib.suppress(ValueError):
            value = loads_strict(text)
            if any(value == c and type(value) is type(c) for c in choices):
                return value
    if any(key in schema for key in _CHECKED_STRING):
        return text.strip()  # the grammar checks such a string without its padding
    return text


def _strip_template_newlines(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _read_name(text: str, pos: int) -> tuple[str, int]:
    """The NAME of `<function=NAME>` / `<parameter=NAME>` (pos is just after '=')."""
    end = text.find(">", pos)
    name = text[pos:end] if end >= 0 else ""
    if not name or any(c.isspace() or c == "<" for c in name):
        raise MalformedCall(f"bad name at {pos}")
    return name, end + 1


def read_xml_call(text: str, pos: int, schemas: ToolSchemas) -> tuple[str, dict, int]:
    pos = expect(text, skip_whitespace(text, pos), FUNCTION_OPEN)
    name, pos = _read_name(text, pos)
    properties = schemas.get(name, {}) if schemas is not None else None
    arguments: dict[str, Any] = {}
    while True:
        pos = skip_whitespace(text, pos)
        if text.startswith(FUNCTION_CLOSE, pos):
            pos += len(FUNCTION_CLOSE)
            break
        arg, pos = _read_name(text, expect(text, pos, PARAMETER_OPEN))
        end = text.find(PARAMETER_CLOSE, pos)
        if end < 0:
            raise MalformedCall(f"parameter {arg!r} is not closed")
        if arg in arguments:
            raise MalformedCall(f"parameter {arg!r} given twice")
        raw = _strip_template_newlines(text[pos:end])
        arguments[arg] = raw if properties is None else typed_value(raw, properties.get(arg))
        pos = end + len(PARAMETER_CLOSE)
    return name, arguments, expect(text, skip_whitespace(text, pos), CALL_CLOSE)


class Qwen3XmlToolParser(FramedToolParser):
    name = "qwen3_xml"
    tags = (CALL_OPEN, CALL_CLOSE, FUNCTION_OPEN, FUNCTION_CLOSE, PARAMETER_OPEN, PARAMETER_CLOSE)
    read_call = staticmethod(read_xml_call)

"""Hermes-style calls, as Qwen3's (and Qwen2.5's) template asks for them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The body is one JSON object with exactly the keys "name" (a non-empty string)
and "arguments" (an object). Its arguments are JSON already, so they are passed
through as given (re-serialized compactly), not re-typed against the schema.
Anything else inside the tags (extra keys, arguments as a string, trailing
text, NaN) is a malformed call, which fails the whole parse (see base.py).
"""

from __future__ import annotations

from .base import (CALL_CLOSE, CALL_OPEN, JSON_DECODER, FramedToolParser, MalformedCall,
                   ToolSchemas, expect, skip_whitespace)


def read_hermes_call(text: str, pos: int, schemas: ToolSchemas) -> tuple[str, dict, int]:
    pos = skip_whitespace(text, pos)
    try:
        body, pos = JSON_DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError) as e:
        raise MalformedCall(f"not a JSON object: {e}") from e
    if not isinstance(body, dict) or set(body) != {"name", "arguments"}:
        raise MalformedCall('a call is {"name": ..., "arguments": {...}}')
    name, arguments = body["name"], body["arguments"]
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise MalformedCall("name must be a non-empty string and arguments an object")
    return name, arguments, expect(text, skip_whitespace(text, pos), CALL_CLOSE)


class HermesToolParser(FramedToolParser):
    name = "hermes"
    tags = (CALL_OPEN, CALL_CLOSE)
    read_call = staticmethod(read_hermes_call)

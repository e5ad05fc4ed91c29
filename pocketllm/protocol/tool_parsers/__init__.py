"""Tool-call parsers: one module per call syntax a checkpoint's template teaches.

Pure functions of the generated text and the request's tools; nothing here
touches the engine. A syntax is parsed only when the checkpoint's own chat
template spells it out (parser_for_template): inventing a parse for a syntax
nobody has read would drop or corrupt calls silently.
"""

from __future__ import annotations

from typing import Optional

from ...errors import UnsupportedFeatureError
from .base import (Delta, HeldCallStream, IdFactory, ParsedToolCalls, ToolCall, ToolParser,
                   ToolStreamParser, new_call_id, tool_schemas)
from .hermes import HermesToolParser
from .qwen3_xml import Qwen3XmlToolParser

PARSERS = {"hermes": HermesToolParser, "qwen3_xml": Qwen3XmlToolParser}

__all__ = ["Delta", "HeldCallStream", "HermesToolParser", "ParsedToolCalls", "Qwen3XmlToolParser",
           "ToolCall", "ToolParser", "ToolStreamParser", "get_tool_parser", "new_call_id",
           "parser_for_template", "tool_schemas"]


def get_tool_parser(name: str, *, id_factory: Optional[IdFactory] = None) -> ToolParser:
    """A parser by name; id_factory replaces the random call ids (tests)."""
    cls = PARSERS.get(name)
    if cls is None:
        raise UnsupportedFeatureError(
            f"no tool-call parser named {name!r}; known: {', '.join(sorted(PARSERS))}")
    return cls(id_factory or new_call_id)


def parser_for_template(chat_template: Optional[str]) -> Optional[ToolParser]:
    """The parser for the call syntax a chat template teaches, or None when it teaches none
    this server has read (the call then stays in content, as before).

    Qwen3-Coder / qwen3_5 templates write calls as `<tool_call><function=NAME>
    <parameter=ARG>` XML; Qwen3 / Qwen2.5 (and Hermes) templates ask for
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>`. The XML check comes
    first because the XML templates also mention JSON (tojson of argument values).
    """
    if chat_template is None or "<tool_call>" not in chat_template:
        return None
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return get_tool_parser("qwen3_xml")
    if '"arguments"' in chat_template or "\\\"arguments\\\"" in chat_template:
        return get_tool_parser("hermes")
    return None

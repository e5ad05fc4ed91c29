"""Tools on a chat request: validating `tools` / `tool_choice` / `parallel_tool_calls`, and
the grammar that enforces the choice while the model generates.

Two halves, because the template and the parser live in the tokenizer stage:
  - `tool_options` (frontend: HTTP and offline) checks the fields and returns the
    chat_options entries that carry them to the tokenizer stage;
  - `take_tool_options` + `tool_split` (tokenizer stage) keep the template's
    variables apart from ours, pick the parser the template teaches, fill the
    OutputSplit's tool fields and set `sampling.structured` to a structural tag.

What each choice means (docs/api.md "Tool calls"):
  none      tools are not rendered and nothing is parsed: the model is not told
            about them, and any call-like text it writes stays content.
  auto      free text; once the model opens `<tool_call>` the rest of the output
            must be well-formed calls (names among the tools, arguments matching
            their schemas), separated by newlines only, then the answer ends.
  required  the output is one or more calls and nothing else.
  named     the output is exactly one call of that function.
  parallel_tool_calls false: at most one call (auto) / exactly one (required).
A thinking block the template teaches comes first, unconstrained.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

import msgspec

from ..errors import InvalidRequestError, UnsupportedFeatureError
from ..proto.messages import OutputSplit, SamplingSpec, StructuredSpec
from .reasoning import REASONING_END, REASONING_START
from .tool_parsers import ToolParser, tool_schemas

# OpenAI's rule for function names; it also keeps names safe inside either call syntax.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICE_MODES = ("none", "auto", "required")
# chat_options keys that are ours, not template variables.
_PRIVATE_KEYS = ("tool_choice", "parallel_tool_calls")


def tool_options(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None, *,
                 response_format: Any = None, template_kwargs: Optional[dict] = None) -> dict:
    """Validate the request's tool fields; the chat_options entries that carry them.

    Raises InvalidRequestError naming the field. No tools and no constraining
    choice gives {} (the request renders and decodes as without tools).
    """
    for key in ("tools", *_PRIVATE_KEYS):
        if template_kwargs and key in template_kwargs:
            raise InvalidRequestError(
                f'"chat_template_kwargs" may not set {key!r}: send it as the request\'s own '
                f'"{key}" field, so it is validated and acted on', "chat_template_kwargs")
    schemas = tool_schemas(tools)
    if schemas is not None:
        for name in schemas:
            if not _NAME.fullmatch(name):
                raise InvalidRequestError(
                    f"tool name {name!r} is not allowed: names are 1-64 characters of a-z, A-Z, "
                    "0-9, '_' and '-'", "tools")
        for tool in tools:
            _parameters(tool["function"])  # refuse a non-object schema up front
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError('"parallel_tool_calls" must be a boolean', "parallel_tool_calls")
    choice = _choice(tool_choice, schemas)
    if schemas is None or choice == "none":
        return {}
    if response_format not in (None, {"type": "text"}):
        raise InvalidRequestError(
            '"response_format" cannot be combined with "tools": both constrain the same output '
            'and no grammar serves both. Send "tool_choice": "none", or leave one of them out.',
            "response_format")
    return {"tools": tools, "tool_choice": choice,
            "parallel_tool_calls": True if parallel_tool_calls is None else parallel_tool_calls}


def _choice(choice: Any, schemas: Optional[dict]) -> Any:
    if choice is None:
        return "auto" if schemas else "none"
    if isinstance(choice, str):
        if choice not in CHOICE_MODES:
            raise InvalidRequestError(
                f'"tool_choice" = {choice!r} is not one of "none", "auto", "required", or '
                '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if choice == "required" and not schemas:
            raise InvalidRequestError('"tool_choice": "required" needs "tools" to call',
                                      "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or \
            not isinstance(name, str):
        raise InvalidRequestError(
            '"tool_choice" must be "none", "auto", "required", or {"type": "function", '
            '"function": {"name": ...}}', "tool_choice")
    if not schemas or name not in schemas:
        raise InvalidRequestError(f'"tool_choice" names function {name!r}, which is not among '
                                  'the request\'s "tools"', "tool_choice")
    return {"type": "function", "function": {"name": name}}


def _parameters(fn: dict) -> dict:
    """The function's argument schema as a JSON-object schema (absent: any object)."""
    params = fn.get("parameters")
    if params is None:
        return {"type": "object"}
    declared = params.get("type", "object")
    if declared != "object":
        raise InvalidRequestError(
            f"function {fn['name']!r}: parameters must be a JSON schema of type \"object\", "
            f"not {declared!r}", "tools")
    return {**params, "type": "object"}


# ---------------------------------------------------------------- tokenizer stage


@dataclass
class ToolRequest:
    tools: Optional[list] = None  # None: no tools, or tool_choice "none"
    choice: Any = "none"
    parallel: bool = True


def take_tool_options(opts: dict) -> ToolRequest:
    """Remove our keys from the template's variables; under "none" the tools go too."""
    choice = opts.pop("tool_choice", "none")
    parallel = opts.pop("parallel_tool_calls", True)
    if choice == "none":
        opts.pop("tools", None)
        return ToolRequest()
    return ToolRequest(opts.get("tools"), choice, parallel)


def tool_split(req: ToolRequest, parser: Optional[ToolParser], split: Optional[OutputSplit],
               sampling: SamplingSpec) -> tuple[Optional[OutputSplit], SamplingSpec]:
    """The OutputSplit's tool fields and the grammar enforcing the choice."""
    if not req.tools:
        return split, sampling
    if parser is None:
        raise UnsupportedFeatureError(
            "this checkpoint's chat template teaches no tool-call syntax PocketLLM parses, so "
            'under "tool_choice": "auto" nothing says how the model marks a call. Send '
            '"tool_choice": "required" or a named function (enforced by the grammar on any '
            "model), or start the server with --tool-call-parser hermes|qwen3_xml to name the "
            "syntax the model writes", "tools")
    if sampling.structured is not None:  # the frontends refuse this; a stage-level guard
        raise InvalidRequestError('"response_format" cannot be combined with "tools"',
                                  "response_format")
    split = split if split is not None else OutputSplit()
    split = msgspec.structs.replace(split, tool_parser=parser.name, tools=req.tools)
    # The stage compiles it once without a vocabulary (scheduler/grammar.py check_spec), so a
    # schema xgrammar cannot serve is a 400 naming "tools" before anything is scheduled.
    tag = structural_tag(parser.name, req.tools, req.choice, req.parallel, split)
    return split, msgspec.structs.replace(
        sampling, structured=StructuredSpec(kind="structural_tag", value=tag, param="tools"))


# ---------------------------------------------------------------- the grammar

# Where each syntax's call starts, what the arguments look like, where it ends.
# Hermes: <tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>, as Qwen3's template asks.
# XML: <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>...
#      \n</function>\n</tool_call>.
CALL_OPEN = "<tool_call>"
# Whitespace between JSON tokens of the arguments, at most this many in a row (whitespace
# inside string values is free): JSON whitespace means nothing, and without a bound a model
# can spend its whole budget on it.
MAX_WHITESPACE = 8


def _call_tag(syntax: str, name: str, params: dict, opened: bool = False) -> dict:
    """One call of `name` as a structural-tag `tag`; opened: `<tool_call>` already written."""
    if syntax == "hermes":
        begin = CALL_OPEN + '\n{"name": ' + json.dumps(name) + ', "arguments": '
        content = {"type": "json_schema", "json_schema": params,
                   "max_whitespace_cnt": MAX_WHITESPACE}
        end = "}\n</tool_call>"
    elif syntax == "qwen3_xml":
        begin = CALL_OPEN + "\n<function=" + name + ">\n"
        content = {"type": "json_schema", "json_schema": params, "style": "qwen_xml",
                   "max_whitespace_cnt": MAX_WHITESPACE}
        end = "\n</function>\n</tool_call>"
    else:
        raise UnsupportedFeatureError(f"no grammar for the tool-call syntax {syntax!r}")
    if opened:
        begin = begin[len(CALL_OPEN):]
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _calls(syntax: str, tools: list, parallel: bool, opened: bool) -> dict:
    """One call of any tool, then (parallel) more calls, each after a newline."""
    def any_call(opened: bool) -> dict:
        tags = [_call_tag(syntax, t["function"]["name"], _parameters(t["function"]), opened)
                for t in tools]
        return tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}

    first = any_call(opened)
    if not parallel:
        return first
    more = {"type": "star", "content": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "\n"}, any_call(False)]}}
    return {"type": "sequence", "elements": [first, more]}


# After </think> the template leaves a blank line or two before the answer.
_AFTER_THINKING = {"type": "regex", "pattern": "[ \\n]{0,4}"}


def _thinking_prefix(split: OutputSplit) -> Optional[dict]:
    """The template's thinking block, ahead of the calls (xgrammar matches the tags as text)."""
    if split.reasoning_end_id is None:
        return None
    if split.in_reasoning:  # the prompt opened the block: reasoning until </think>
        block = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": REASONING_END}
        return {"type": "sequence", "elements": [block, _AFTER_THINKING]}
    block = {"type": "tag", "begin": REASONING_START, "content": {"type": "any_text"},
             "end": REASONING_END}
    return {"type": "optional", "content": {"type": "sequence",
                                            "elements": [block, _AFTER_THINKING]}}


def structural_tag(syntax: str, tools: list, choice: Any, parallel: bool,
                   split: Optional[OutputSplit] = None) -> str:
    """The xgrammar structural tag (JSON text) for `choice` over `tools` in `syntax`."""
    if isinstance(choice, dict):  # named: exactly one call of that function
        name = choice["function"]["name"]
        body = _calls(syntax, [t for t in tools if t["function"]["name"] == name], False, False)
    elif choice == "required":
        body = _calls(syntax, tools, parallel, False)
    elif choice == "auto":  # free text until <tool_call>, then only calls, then the end
        body = {"type": "dispatch", "loop": False,
                "rules": [[CALL_OPEN, _calls(syntax, tools, parallel, True)]]}
    else:
        raise InvalidRequestError(f"tool_choice {choice!r} has no grammar", "tool_choice")
    prefix = _thinking_prefix(split) if split is not None else None
    if prefix is not None:
        body = {"type": "sequence", "elements": [prefix, body]}
    return json.dumps({"type": "structural_tag", "format": body}, ensure_ascii=False)

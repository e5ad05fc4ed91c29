"""What every tool-call syntax shares: result types, the request's tool schemas,
the all-or-nothing framing of a completion, and the streaming hold-back.

A syntax module supplies only `read_call`: given the text right after one
`<tool_call>`, read that call's name and arguments and return where its
`</tool_call>` ends, or raise MalformedCall. Everything else lives here, so the
two syntaxes cannot disagree about what "all-or-nothing" means.

All-or-nothing (the seed's "Tool calls" rules), for the whole completion:
  - no `<tool_call>` at all: no calls, content is the text unchanged;
  - prose BEFORE the first call is the content, trailing whitespace stripped;
  - between two calls, and after the last, only whitespace is allowed. Prose
    after the last call fails the parse too: a call the model meant to be
    followed by an explanation is indistinguishable from one whose text went
    on past where the syntax said it ended, and handing back a call while
    dropping that prose from the answer would hide what the model wrote;
  - a truncated call (no closing tag), malformed JSON/XML, or (when tools
    were given) a call naming a function the request did not offer: the parse
    fails, there are no calls, and content is the whole text exactly as
    generated.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from ...errors import InvalidRequestError

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

# name -> that function's parameters.properties (possibly empty); None = the request sent no tools.
ToolSchemas = Optional[dict[str, dict]]
IdFactory = Callable[[], str]


def new_call_id() -> str:
    """OpenAI's shape: 'call_' and 24 random hex characters."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, serialized

    def as_openai(self, index: Optional[int] = None) -> dict:
        """The message's tool_calls entry; with index, the streamed delta's entry."""
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update(id=self.id, type="function",
                   function={"name": self.name, "arguments": self.arguments})
        return out


@dataclass
class ParsedToolCalls:
    content: str  # the text outside the calls; the whole text when tool_calls is empty
    tool_calls: list[ToolCall]


@dataclass
class Delta:
    """One streamed piece: either answer text or one whole tool call."""
    content: Optional[str] = None
    tool_call: Optional[dict] = None  # {"index", "id", "type": "function", "function": {...}}

    def as_openai(self) -> dict:
        """The `delta` object of a chat.completion.chunk choice."""
        if self.tool_call is not None:
            return {"tool_calls": [self.tool_call]}
        return {"content": self.content}


class ToolStreamParser(Protocol):
    def feed(self, text_delta: str) -> list[Delta]: ...
    def finish(self) -> list[Delta]: ...


class ToolParser(Protocol):
    name: str
    # The syntax's markup strings: the detokenizer shows any that is one special token as
    # text when this parser reads the answer (skip_special_tokens would drop it).
    tags: tuple[str, ...]

    def parse(self, text: str, tools: Optional[list]) -> ParsedToolCalls: ...
    def stream(self, tools: Optional[list]) -> ToolStreamParser: ...


class MalformedCall(Exception):
    """Internal: the text is not a well-formed call of this syntax (fails the whole parse)."""


def tool_schemas(tools: Any) -> ToolSchemas:
    """Validate the request's `tools` and map each function name to its properties.

    None or [] means "no tools": arguments stay strings and any name is accepted.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("'tools' must be an array of tool definitions", "tools")
    if not tools:
        return None
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(f'{where} must be an object with "type": "function"', "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(f"{where}.function.name must be a non-empty string", "tools")
        params = fn.get("parameters")
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise InvalidRequestError(f"{where}.function.parameters must be an object", "tools")
        props = params.get("properties")
        props = {} if props is None else props
        if not isinstance(props, dict):
            raise InvalidRequestError(
                f"{where}.function.parameters.properties must be an object", "tools")
        if fn["name"] in schemas:
            raise InvalidRequestError(f"{where}: function {fn['name']!r} is defined twice", "tools")
        schemas[fn["name"]] = props
    return schemas


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN/Infinity would re-serialize as invalid JSON


# No NaN/Infinity (Python's default decoder accepts them). Raw control characters inside
# strings (a literal tab or newline in a code argument) are read, as models write them and
# xgrammar's JSON grammar allows them; the arguments handed back are re-serialized, escaped.
JSON_DECODER = json.JSONDecoder(parse_constant=_reject_constant, strict=False)


def loads_strict(text: str) -> Any:
    """json.loads without NaN/Infinity; raises ValueError (also on absurd nesting)."""
    try:
        return JSON_DECODER.decode(text)
    except RecursionError as e:
        raise ValueError("JSON nested too deeply") from e


def dump_arguments(arguments: dict) -> str:
    """Compact JSON, non-ASCII kept as written (what OpenAI's own arguments look like)."""
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def expect(text: str, pos: int, tag: str) -> int:
    """The position after `tag` at pos, or MalformedCall."""
    if not text.startswith(tag, pos):
        raise MalformedCall(f"expected {tag!r} at {pos}")
    return pos + len(tag)


# read_call(text, pos right after <tool_call>, schemas) -> (name, arguments, pos after </tool_call>)
ReadCall = Callable[[str, int, ToolSchemas], "tuple[str, dict, int]"]


def parse_framed(text: str, tools: Any, read_call: ReadCall, id_factory: IdFactory) -> ParsedToolCalls:
    """All-or-nothing parse of a whole completion (rules in the module docstring)."""
    schemas = tool_schemas(tools)  # bad tools are the request's fault, even when no call follows
    start = text.find(CALL_OPEN)
    if start < 0:
        return ParsedToolCalls(text, [])
    found: list[tuple[str, str]] = []
    pos = start
    try:
        while True:
            name, arguments, pos = read_call(text, pos + len(CALL_OPEN), schemas)
            if schemas is not None and name not in schemas:
                raise MalformedCall(f"function {name!r} is not among the request's tools")
            found.append((name, dump_arguments(arguments)))
            pos = skip_whitespace(text, pos)
            if pos == len(text):
                break
            if not text.startswith(CALL_OPEN, pos):
                raise MalformedCall("text after a call")
    except MalformedCall:
        return ParsedToolCalls(text, [])
    calls = [ToolCall(id_factory(), name, arguments) for name, arguments in found]
    return ParsedToolCalls(text[:start].rstrip(), calls)


def _held_suffix(pending: str) -> int:
    """How many trailing chars might still belong to a call: a partial `<tool_call>`
    and the whitespace before it (the parse strips it from content when a call follows)."""
    partial = 0
    for k in range(min(len(CALL_OPEN) - 1, len(pending)), 0, -1):
        if pending.endswith(CALL_OPEN[:k]):
            partial = k
            break
    cut = len(pending) - partial
    while cut > 0 and pending[cut - 1].isspace():
        cut -= 1
    return len(pending) - cut


class HeldCallStream:
    """Incremental tool-call parsing for a streamed completion.

    Before the first `<tool_call>`, text is emitted as content as it arrives,
    except for a tail that could still start a call (a partial `<tool_call>`
    and the whitespace before it), held like a stop-string prefix; markup
    therefore never reaches content while a call is still possible (vllm#28297).

    From the first `<tool_call>` on, everything is held, and at finish() the
    whole text goes through the same parse as a non-streamed completion: on
    success the calls are emitted as whole OpenAI-shaped deltas (index, id,
    type, function.name, function.arguments in one piece); on failure the held
    text is released as content, exactly as generated. Holding to the end
    rather than emitting each call as it closes is what keeps a stream
    all-or-nothing like the non-streamed parse: prose after a closed call, or a
    second call truncated at the token budget, fails the whole parse, and a
    call already sent could not be taken back. The cost is that calls arrive
    with the last token rather than one by one; the stream's content, calls
    and ids are identical to parse() of the same text, however it was chunked.
    """

    def __init__(self, parser: ToolParser, tools: Any):
        tool_schemas(tools)  # refuse bad tools before generation, not at the end
        self._parser, self._tools = parser, tools
        self._parts: list[str] = []
        self._pending = ""  # unsent text before the first <tool_call>
        self._sent = 0  # chars already emitted as content (always a prefix of the text)
        self._in_call = False
        self._finished = False

    def feed(self, text_delta: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._parts.append(text_delta)
        if self._in_call:
            return []
        pending = self._pending + text_delta
        start = pending.find(CALL_OPEN)
        if start >= 0:
            self._in_call, self._pending = True, ""
            return self._content(pending[:start].rstrip())
        held = _held_suffix(pending)
        self._pending = pending[len(pending) - held:]
        return self._content(pending[:len(pending) - held])

    def finish(self) -> list[Delta]:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        if not self._in_call:
            return self._content(self._pending)
        text = "".join(self._parts)
        parsed = self._parser.parse(text, self._tools)
        final_content = parsed.content if parsed.tool_calls else text
        out = self._content(final_content[self._sent:])
        out += [Delta(tool_call=call.as_openai(i)) for i, call in enumerate(parsed.tool_calls)]
        return out

    def _content(self, text: str) -> list[Delta]:
        if not text:
            return []
        self._sent += len(text)
        return [Delta(content=text)]


class FramedToolParser:
    """A syntax whose calls stand between `<tool_call>` and `</tool_call>`: a subclass names
    it, lists its ``tags`` and gives its module's ``read_call`` (a staticmethod)."""

    name: str
    tags: tuple[str, ...]  # markup a tokenizer may hold as (special) tokens
    read_call: ReadCall

    def __init__(self, id_factory: IdFactory = new_call_id):
        self._new_id = id_factory

    def parse(self, text: str, tools: Optional[list[Any]]) -> ParsedToolCalls:
        return parse_framed(text, tools, self.read_call, self._new_id)

    def stream(self, tools: Optional[list[Any]]) -> HeldCallStream:
        return HeldCallStream(self, tools)

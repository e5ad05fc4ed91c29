"""What the offline API hands back: whole results, stream events, usage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .proto.messages import LogprobEntry, RequestOutput, ToolCallOut


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class TokenEvent:
    """One streamed step of one request: the text and token ids it gained."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: Optional[str] = None
    usage: Optional[Usage] = None
    logprobs: list[LogprobEntry] = field(default_factory=list)
    # chat with a thinking block: its text and its tokens' entries (``text`` is the answer)
    reasoning_text: str = ""
    reasoning_logprobs: list[LogprobEntry] = field(default_factory=list)
    # chat with tools: whole parsed calls (id, name, arguments as JSON text), on the last event
    tool_calls: list[ToolCallOut] = field(default_factory=list)

    @classmethod
    def from_wire(cls, out: RequestOutput) -> "TokenEvent":
        usage = None if out.usage is None else Usage(
            out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.cached_tokens)
        return cls(out.request_id, out.text, list(out.token_ids), out.finished,
                   out.finish_reason, usage, list(out.logprobs), out.reasoning_text,
                   list(out.reasoning_logprobs), list(out.tool_calls))


@dataclass
class GenerationOutput:
    """The whole result of one request."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    usage: Usage = field(default_factory=Usage)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    reasoning_text: str = ""  # the thinking block, apart from the answer in ``text``
    reasoning_logprobs: list[LogprobEntry] = field(default_factory=list)
    # parsed tool calls (finish_reason "tool_calls"); ``text`` is then the prose before them
    tool_calls: list[ToolCallOut] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: TokenEvent) -> None:
        self.text += event.text
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        self.reasoning_text += event.reasoning_text
        self.reasoning_logprobs.extend(event.reasoning_logprobs)
        self.tool_calls.extend(event.tool_calls)
        if event.usage is not None:
            self.usage = event.usage
        if event.finished:
            self.finish_reason = event.finish_reason

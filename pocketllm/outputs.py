"""What the offline API hands back: a request's whole result, accumulated from its deltas.

A streamed event is the engine's own ``RequestOutput`` delta (exported as ``TokenEvent``),
and usage is the wire ``Usage``: one shape from the detokenizer to the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .proto.messages import LogprobEntry, RequestOutput, ToolCallOut, Usage

TokenEvent = RequestOutput  # one streamed step of one request: the text and tokens it gained


@dataclass
class GenerationOutput:
    """The whole result of one request (one choice)."""

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

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.reasoning_text += out.reasoning_text
        self.reasoning_logprobs.extend(out.reasoning_logprobs)
        self.tool_calls.extend(out.tool_calls)
        if out.usage is not None:
            self.usage = out.usage
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"


__all__ = ["GenerationOutput", "TokenEvent", "Usage"]

"""OpenAI response shapes: errors, whole responses, stream chunks, logprobs."""

from __future__ import annotations

import json
from typing import Any, Optional

from aiohttp import web

from ..errors import error_spec
from ..proto.messages import LogprobEntry, ToolCallOut


def error_body(message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: Optional[str] = None, code: Optional[str] = None) -> web.Response:
    return web.json_response(error_body(message, type_, param, code), status=status)


def exception_body(e: BaseException) -> tuple[int, dict]:
    """An error's HTTP status and OpenAI body, by its kind (pocketllm/errors.py ERRORS)."""
    spec = error_spec(e)
    return spec.status, error_body(str(e) or spec.type, spec.type, getattr(e, "param", None),
                                   spec.code)


def _entry(e: LogprobEntry) -> dict:
    return {"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes)}


def chat_logprobs(entries: list[LogprobEntry],
                  reasoning: Optional[list[LogprobEntry]] = None) -> dict:
    """``content``: the answer's tokens; ``reasoning_content`` (only when there are any):
    the thinking block's, so each array's bytes reassemble its own field."""
    out: dict = {"content": [_ranked(e) for e in entries]}
    if reasoning:
        out["reasoning_content"] = [_ranked(e) for e in reasoning]
    return out


def _ranked(e: LogprobEntry) -> dict:
    return {**_entry(e), "top_logprobs": [_entry(t) for t in e.top]}


def completion_logprobs(entries: list[LogprobEntry], start: int = 0) -> dict:
    """The legacy completions shape, plus the per-token ``content`` list with bytes.
    ``start``: the text offset of the first entry (a stream chunk's place in the text)."""
    offsets, pos = [], start
    for e in entries:
        offsets.append(pos)
        pos += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets,
            "content": chat_logprobs(entries)["content"]}


def chat_choice(index: int, text: str, finish_reason: Optional[str],
                logprobs: Optional[list[LogprobEntry]], reasoning: str = "",
                reasoning_logprobs: Optional[list[LogprobEntry]] = None,
                tool_calls: Optional[list[ToolCallOut]] = None) -> dict:
    message: dict = {"role": "assistant", "content": text}
    if tool_calls:  # OpenAI: content is null when the answer is only calls
        message["content"] = text or None
        message["tool_calls"] = [tool_call(c) for c in tool_calls]
    if reasoning:  # a thinking block (not dropped): beside content, as vLLM/DeepSeek name it
        message["reasoning_content"] = reasoning
    return {"index": index, "message": message,
            "logprobs": None if logprobs is None else chat_logprobs(logprobs,
                                                                    reasoning_logprobs),
            "finish_reason": finish_reason}


def tool_call(call: ToolCallOut, index: Optional[int] = None) -> dict:
    """A message's tool_calls entry; with index, a streamed delta's (the whole call at once)."""
    out: dict = {} if index is None else {"index": index}
    out.update(id=call.id, type="function",
               function={"name": call.name, "arguments": call.arguments})
    return out


def completion_choice(index: int, text: str, finish_reason: Optional[str],
                      logprobs: Optional[list[LogprobEntry]]) -> dict:
    return {"index": index, "text": text,
            "logprobs": None if logprobs is None else completion_logprobs(logprobs),
            "finish_reason": finish_reason}


def chat_chunk_choice(index: int, delta: dict, finish_reason: Optional[str] = None,
                      logprobs: Optional[dict] = None) -> dict:
    """``logprobs``: the entries of this chunk's own tokens (chat_logprobs), or None."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk_choice(index: int, text: str, finish_reason: Optional[str] = None,
                            logprobs: Optional[dict] = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


# Characters that str.splitlines() (and so httpx's iter_lines and many hand-written SSE
# readers) takes for line ends, though SSE ends lines only at CR and LF: escaped in a data
# line's JSON, so no such reader cuts a chunk that carries one in its text.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: Any) -> bytes:
    if isinstance(data, str):
        payload = data
    else:
        payload = json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS)
    return f"data: {payload}\n\n".encode()

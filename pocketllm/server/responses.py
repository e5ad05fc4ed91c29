"""OpenAI response shapes: errors, whole responses, stream chunks, logprobs."""

from __future__ import annotations

import json
from typing import Any, Optional

from aiohttp import web

from ..proto.messages import LogprobEntry


def error_body(message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: Optional[str] = None, code: Optional[str] = None) -> web.Response:
    return web.json_response(error_body(message, type_, param, code), status=status)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _entry(e: LogprobEntry) -> dict:
    return {"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes)}


def chat_logprobs(entries: list[LogprobEntry]) -> dict:
    return {"content": [{**_entry(e), "top_logprobs": [_entry(t) for t in e.top]}
                        for e in entries]}


def completion_logprobs(entries: list[LogprobEntry]) -> dict:
    """The legacy completions shape, plus the per-token ``content`` list with bytes."""
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets,
            "content": chat_logprobs(entries)["content"]}


def chat_choice(index: int, text: str, finish_reason: Optional[str],
                logprobs: Optional[list[LogprobEntry]]) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": None if logprobs is None else chat_logprobs(logprobs),
            "finish_reason": finish_reason}


def completion_choice(index: int, text: str, finish_reason: Optional[str],
                      logprobs: Optional[list[LogprobEntry]]) -> dict:
    return {"index": index, "text": text,
            "logprobs": None if logprobs is None else completion_logprobs(logprobs),
            "finish_reason": finish_reason}


def chat_chunk_choice(index: int, delta: dict, finish_reason: Optional[str] = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def completion_chunk_choice(index: int, text: str, finish_reason: Optional[str] = None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def sse(data: Any) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()

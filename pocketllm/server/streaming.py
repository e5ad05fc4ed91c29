"""One HTTP request's choices: submit them, merge their deltas, answer whole or as SSE.

Each choice is its own scheduler request. The group shares one deadline (the
request's), and whatever ends the HTTP exchange — completion, timeout, DELETE
or a client that hung up — aborts every choice still running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from aiohttp import web

from ..api.client import EngineClient
from ..errors import PocketLLMError, RequestFailedError, RequestTimeoutError
from ..proto.messages import LogprobEntry, RequestOutput, ToolCallOut
from ..protocol.openai_fields import ParsedRequest
from . import responses as R
from .metrics import RequestTimer

log = logging.getLogger("pocketllm.server")


_SHUTDOWN = object()  # queued by end_for_shutdown(now=True): end without the engine


def _shutting_down() -> web.Response:
    return R.error_response(503, "the server is shutting down; retry on another instance",
                            "service_unavailable", code="shutting_down")


class _Choice:
    def __init__(self, timer: RequestTimer):
        self.text = ""
        self.logprobs: list[LogprobEntry] = []
        self.reasoning = ""  # the thinking block's text (chat), when not dropped
        self.reasoning_logprobs: list[LogprobEntry] = []
        self.text_offset = 0  # completions stream: where the next chunk's entries start
        self.tool_calls: list[ToolCallOut] = []  # parsed calls (they arrive whole, at finish)
        self.finish_reason: Optional[str] = None
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.started = False
        self.closed = False  # its closing chunk (the one with finish_reason) was streamed
        self.tokens_seen = 0  # usage for a choice the server had to cut (it never got one)
        self.timer = timer


class ChoiceGroup:
    def __init__(self, state, client: EngineClient, parsed: ParsedRequest, kind: str, rid: str):
        self.state = state
        self.client = client
        self.parsed = parsed
        self.kind = kind
        self.rid = rid
        self.ids = [c.request_id for c in parsed.choices]
        self.queue: asyncio.Queue = asyncio.Queue()
        start = time.monotonic()
        self.choices = [_Choice(RequestTimer(state.metrics, start)) for _ in self.ids]
        self.created = int(time.time())
        self.deadline = None if not state.request_timeout else start + state.request_timeout
        self.timed_out = False
        self.shutting_down = False  # the server is stopping: end now, with what there is
        self.prefix = "chatcmpl-" if kind == "chat" else "cmpl-"

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def cancel(self) -> None:
        """Abort every running choice; their final deltas still reach this group."""
        live = [rid for rid, c in zip(self.ids, self.choices) if c.finish_reason is None]
        if live:
            self.client.abort(live)

    def end_for_shutdown(self, now: bool = False) -> None:
        """The drain is over: abort what still runs, so each choice ends with the engine's
        own "abort" delta (and its usage); ``now``: do not wait for the engine either."""
        self.shutting_down = True
        self.cancel()
        if now:
            self.queue.put_nowait((-1, _SHUTDOWN))

    def _cut_unfinished(self) -> None:
        now = time.monotonic()
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason = "abort"
                c.completion_tokens = c.completion_tokens or c.tokens_seen
                c.timer.on_finish(now, "abort", c.prompt_tokens, c.completion_tokens)

    def _produced_nothing(self) -> bool:
        return all(c.tokens_seen == 0 and not c.text for c in self.choices)

    def close(self) -> None:
        """The exchange is over (done, timed out, or the client left): stop what still runs
        and count it as aborted, since nobody will read its last delta."""
        self.cancel()
        now = time.monotonic()
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason = "abort"
                c.timer.on_finish(now, "abort", c.prompt_tokens, c.completion_tokens)

    def _submit(self) -> None:
        loop = asyncio.get_running_loop()
        for i, req in enumerate(self.parsed.choices):
            self.client.submit(req, lambda item, i=i: loop.call_soon_threadsafe(
                self.queue.put_nowait, (i, item)))

    async def _next(self) -> Optional[tuple[int, RequestOutput]]:
        """The next delta of any choice; None when the deadline passed or all finished."""
        while not self.finished:
            timeout = None if self.deadline is None else self.deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                self.timed_out = True
                return None
            try:
                i, item = await asyncio.wait_for(self.queue.get(), timeout)
            except asyncio.TimeoutError:
                self.timed_out = True
                return None
            if item is _SHUTDOWN:
                self._cut_unfinished()
                return None
            if isinstance(item, Exception):
                self.choices[i].finish_reason = "error"
                raise item
            self._account(i, item)
            return i, item
        return None

    def _account(self, i: int, out: RequestOutput) -> None:
        c = self.choices[i]
        now = time.monotonic()
        c.text += out.text
        c.logprobs.extend(out.logprobs)
        c.reasoning += out.reasoning_text
        c.reasoning_logprobs.extend(out.reasoning_logprobs)
        c.tool_calls.extend(out.tool_calls)
        c.tokens_seen += len(out.token_ids)
        c.timer.on_delta(now, len(out.token_ids))
        if out.usage is not None:
            c.prompt_tokens = out.usage.prompt_tokens
            c.completion_tokens = out.usage.completion_tokens
            c.cached_tokens = out.usage.cached_tokens
        if out.finished:
            c.finish_reason = out.finish_reason or "stop"
            c.timer.on_finish(now, c.finish_reason, c.prompt_tokens, c.completion_tokens)

    def usage(self) -> dict:
        n = len(self.ids) // self.parsed.prompt_count
        prompt = cached = 0
        for p in range(self.parsed.prompt_count):  # each prompt counted once
            first = next((c for c in self.choices[p * n:(p + 1) * n] if c.prompt_tokens), None)
            if first is not None:
                prompt += first.prompt_tokens
                cached += first.cached_tokens
        return R.usage_dict(prompt, sum(c.completion_tokens for c in self.choices), cached)

    # ---------------------------------------------------------------- answers

    async def respond(self, request: web.Request) -> web.StreamResponse:
        self._submit()
        if self.parsed.stream:
            return await self._stream(request)
        return await self._whole()

    async def _whole(self) -> web.Response:
        while await self._next() is not None:
            pass
        if self.shutting_down and self._produced_nothing():
            return _shutting_down()
        done = [(i, c) for i, c in enumerate(self.choices)
                if c.finish_reason is not None and c.finish_reason != "error"]
        if not done:
            if self.timed_out:
                raise RequestTimeoutError("the request timed out before any choice finished")
            raise RequestFailedError("no choice finished")
        if self.parsed.best_of > self.parsed.n:
            done = self._best(done)
        lp = self.parsed.logprobs
        if self.kind == "chat":
            choices = [R.chat_choice(i, c.text, c.finish_reason, c.logprobs if lp else None,
                                     c.reasoning, c.reasoning_logprobs, c.tool_calls)
                       for i, c in done]
        else:
            choices = [R.completion_choice(i, c.text, c.finish_reason,
                                           c.logprobs if lp else None) for i, c in done]
        return web.json_response({
            "id": self.prefix + self.rid,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created, "model": self.state.model_name,
            "choices": choices,
            "usage": self.usage()}, headers={"X-Request-Id": self.rid})

    def _best(self, done: list[tuple[int, _Choice]]) -> list[tuple[int, _Choice]]:
        """best_of: per prompt, the n finished candidates of highest cumulative logprob
        (sum over the tokens of the returned text), re-indexed 0..n-1 per prompt."""
        n, best_of = self.parsed.n, self.parsed.best_of
        out = []
        for p in range(self.parsed.prompt_count):
            group = [c for i, c in done if i // best_of == p]
            group.sort(key=lambda c: sum(e.logprob for e in c.logprobs), reverse=True)
            out += [(p * n + j, c) for j, c in enumerate(group[:n])]
        return out

    def _chunk(self, choices: list[dict], usage: Optional[dict] = None) -> bytes:
        body = {"id": self.prefix + self.rid,
                "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.state.model_name, "choices": choices}
        if self.parsed.include_usage:
            body["usage"] = usage
        return R.sse(body)

    def _delta_choice(self, i: int, text: str, finish: Optional[str],
                      out: Optional[RequestOutput] = None) -> dict:
        """``out``: the engine delta this chunk carries (its reasoning text and its own
        tokens' log probabilities), None for the closing chunk."""
        c = self.choices[i]
        lp = None
        if self.parsed.logprobs and out is not None:
            if self.kind == "chat":
                lp = R.chat_logprobs(out.logprobs, out.reasoning_logprobs)
            else:
                lp = R.completion_logprobs(out.logprobs, c.text_offset)
                c.text_offset += sum(len(e.token) for e in out.logprobs)
        if self.kind == "completion":
            return R.completion_chunk_choice(i, text, finish, lp)
        delta: dict = {}
        if not c.started:
            delta["role"] = "assistant"
            c.started = True
        if out is not None and out.reasoning_text:
            delta["reasoning_content"] = out.reasoning_text
        if out is not None and out.tool_calls:  # indexed across the choice's calls
            first = len(c.tool_calls) - len(out.tool_calls)
            delta["tool_calls"] = [R.tool_call(call, first + k)
                                   for k, call in enumerate(out.tool_calls)]
        if text or (finish is None and "reasoning_content" not in delta
                    and "tool_calls" not in delta):
            delta["content"] = text
        return R.chat_chunk_choice(i, delta, finish, lp)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        # Wait for the first delta before answering, so a refusal from the tokenizer is a 400.
        first = await self._next()
        if self.shutting_down and self._produced_nothing():
            return _shutting_down()  # nothing sent yet: a retryable answer, not an empty stream
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Request-Id": self.rid})
        await resp.prepare(request)
        item = first
        try:
            while item is not None:
                i, out = item
                if (out.text or out.reasoning_text or out.logprobs or out.reasoning_logprobs
                        or out.tool_calls
                        or (not out.finished and not self.choices[i].started)):
                    await resp.write(self._chunk([self._delta_choice(i, out.text, None, out)]))
                if out.finished:
                    self.choices[i].closed = True
                    await resp.write(self._chunk([self._delta_choice(
                        i, "", self.choices[i].finish_reason)]))
                item = await self._next()
            for i, c in enumerate(self.choices):  # cut by the shutdown: close each one
                if c.finish_reason == "abort" and not c.closed:
                    await resp.write(self._chunk([self._delta_choice(i, "", "abort")]))
        except ConnectionError:
            raise  # the client left
        except Exception as e:  # noqa: BLE001 - the stream ends with the error's own event
            if not isinstance(e, PocketLLMError):
                log.error("a stream failed in the server", exc_info=e)  # a bug: its traceback
            await resp.write(R.sse(R.exception_body(e)[1]))
        if self.parsed.include_usage and not self.timed_out:
            await resp.write(self._chunk([], self.usage()))
        await resp.write(R.sse("[DONE]"))
        await resp.write_eof()
        return resp

"""One HTTP request's answer, whole or as SSE, over the shared request lifecycle.

Each choice is its own engine request; ``api/lifecycle.Generation`` submits them, merges
their deltas, holds the request's deadline and aborts what still runs when the HTTP
exchange ends (completion, timeout, DELETE or a client that hung up). This module only
shapes the answer and feeds the metrics.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from aiohttp import web

from ..api.client import EngineClient
from ..api.lifecycle import Generation
from ..errors import PocketLLMError, RequestFailedError, RequestTimeoutError
from ..outputs import GenerationOutput
from ..proto.messages import RequestOutput
from ..protocol.openai_fields import ParsedRequest
from . import responses as R
from .metrics import RequestTimer

log = logging.getLogger("pocketllm.server")


def _shutting_down() -> web.Response:
    return R.error_response(503, "the server is shutting down; retry on another instance",
                            "service_unavailable", code="shutting_down")


class _Choice:
    """What answering one choice needs beyond its result (``Generation.outputs``)."""

    def __init__(self, timer: RequestTimer):
        self.timer = timer
        self.text_offset = 0  # completions stream: where the next chunk's entries start
        self.started = False  # chat stream: its first chunk (with the role) was sent
        self.closed = False  # its closing chunk (the one with finish_reason) was streamed


class ChoiceGroup:
    """One HTTP request's answer over its ``Generation`` (api/lifecycle.py)."""

    def __init__(self, state, client: EngineClient, parsed: ParsedRequest, kind: str, rid: str):
        self.state = state
        self.parsed = parsed
        self.kind = kind
        self.rid = rid
        self.gen = Generation(client, parsed.choices, state.request_timeout)
        start = time.monotonic()
        self.choices = [_Choice(RequestTimer(state.metrics, start)) for _ in parsed.choices]
        self.outputs = self.gen.outputs
        self.created = int(time.time())
        self.shutting_down = False  # the server is stopping: end now, with what there is
        self.prefix = "chatcmpl-" if kind == "chat" else "cmpl-"

    def end_for_shutdown(self, now: bool = False) -> None:
        """The drain is over: abort what still runs, so each choice ends with the engine's
        own "abort" delta (and its usage); ``now``: do not wait for the engine either."""
        self.shutting_down = True
        self.gen.cancel()
        if now:
            self.gen.cut()

    def _finish_unfinished(self, count_seen: bool) -> None:
        """Count what never got its last delta as aborted (nobody will read it);
        ``count_seen``: its usage, which never came, counts the tokens seen so far."""
        now = time.monotonic()
        for c, o in zip(self.choices, self.outputs):
            if o.finish_reason is None:
                o.finish_reason = "abort"
                if count_seen:
                    o.usage.completion_tokens = o.usage.completion_tokens or len(o.token_ids)
                c.timer.on_finish(now, "abort", o.usage.prompt_tokens, o.usage.completion_tokens)

    def _produced_nothing(self) -> bool:
        return all(not o.token_ids and not o.text for o in self.outputs)

    def close(self) -> None:
        """The exchange is over (done, timed out, or the client left): stop what still runs."""
        self.gen.cancel()
        self._finish_unfinished(count_seen=False)

    async def _next(self) -> Optional[tuple[int, RequestOutput]]:
        """The next delta of any choice; None when the deadline passed or all finished."""
        item = await self.gen.next()
        now = time.monotonic()
        if item is None:
            if self.gen.was_cut:  # the shutdown ends it: the server answers with what it has
                self._finish_unfinished(count_seen=True)
            return None
        i, out = item
        timer, o = self.choices[i].timer, self.outputs[i]
        timer.on_delta(now, len(out.token_ids))
        if out.finished:
            timer.on_finish(now, o.finish_reason, o.usage.prompt_tokens, o.usage.completion_tokens)
        return item

    def usage(self) -> dict:
        return self.gen.usage(self.parsed.prompt_count).as_dict()

    # ---------------------------------------------------------------- answers

    async def respond(self, request: web.Request) -> web.StreamResponse:
        self.gen.submit()  # the caller's close() aborts what still runs, however it ends
        if self.parsed.stream:
            return await self._stream(request)
        return await self._whole()

    async def _whole(self) -> web.Response:
        while await self._next() is not None:
            pass
        if self.shutting_down and self._produced_nothing():
            return _shutting_down()
        done = [(i, o) for i, o in enumerate(self.outputs)
                if o.finish_reason is not None and o.finish_reason != "error"]
        if not done:
            if self.gen.timed_out:
                raise RequestTimeoutError("the request timed out before any choice finished")
            raise RequestFailedError("no choice finished")
        if self.parsed.best_of > self.parsed.n:
            done = self._best(done)
        lp = self.parsed.logprobs
        if self.kind == "chat":
            choices = [R.chat_choice(i, o.text, o.finish_reason, o.logprobs if lp else None,
                                     o.reasoning_text, o.reasoning_logprobs, o.tool_calls)
                       for i, o in done]
        else:
            choices = [R.completion_choice(i, o.text, o.finish_reason,
                                           o.logprobs if lp else None) for i, o in done]
        return web.json_response({
            "id": self.prefix + self.rid,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created, "model": self.state.model_name,
            "choices": choices,
            "usage": self.usage()}, headers={"X-Request-Id": self.rid})

    def _best(self, done: list[tuple[int, GenerationOutput]]
              ) -> list[tuple[int, GenerationOutput]]:
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
            first = len(self.outputs[i].tool_calls) - len(out.tool_calls)
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
                        i, "", self.outputs[i].finish_reason)]))
                item = await self._next()
            for i, c in enumerate(self.choices):  # cut by the shutdown: close each one
                if self.outputs[i].finish_reason == "abort" and not c.closed:
                    await resp.write(self._chunk([self._delta_choice(i, "", "abort")]))
        except ConnectionError:
            raise  # the client left
        except Exception as e:  # noqa: BLE001 - the stream ends with the error's own event
            if not isinstance(e, PocketLLMError):
                log.error("a stream failed in the server", exc_info=e)  # a bug: its traceback
            await resp.write(R.sse(R.exception_body(e)[1]))
        if self.parsed.include_usage and not self.gen.timed_out:
            await resp.write(self._chunk([], self.usage()))
        await resp.write(R.sse("[DONE]"))
        await resp.write_eof()
        return resp

"""The detokenizer stage's logic: TokenBatch in, RequestOutput deltas out.

The process loop (``__main__``) owns the sockets; this class owns per-request
state. Choices, each the simplest that keeps the invariants:

- One RequestOutput per TokenDelta of a live request, even when its text is
  empty (streaming clients see progress). Deltas of unknown requests are ignored:
  that covers requests already finished here, e.g. after a stop string matched
  while the scheduler still had tokens in flight.
- Text passes two hold stages: UTF-8/BPE completion (incremental.py), then the
  stop-string hold-back (stop.py). Token ids and log probabilities travel *with
  their text*: a token is released once all of its bytes are in released text,
  so a stop string can still cut a token that was held. At a cut, a token is
  kept if any of its bytes is in the answer; the last kept log-probability entry
  is trimmed to the bytes inside the answer, so the bytes of all entries always
  concatenate to the answer's UTF-8.
  (Release positions come from each token's own bytes; where the decoded text is
  not byte-for-byte the tokens, i.e. U+FFFD for invalid bytes or a decoder that
  strips a leading space, a token may be released a little early or late;
  everything is released at finish.)
- A finishing delta (finish_reason set by the scheduler, including "abort" and
  "error") flushes everything held and frees the state. A stop-string match
  finishes the request here with finish_reason "stop" (unless the same delta
  reports an error); ``process`` reports its id (when the scheduler had not
  finished it already) so the loop can tell the scheduler to stop computing it.
- Usage rides on the finished output only: completion_tokens counts every
  generated token, the hidden EOS / stop token included, and the tokens cut by
  a stop string.
- Log probabilities: one entry per kept token when the request asked
  (``sampling.logprobs is not None``); sampled token and alternatives are written
  with the request's skip_special_tokens (a skipped special token has text ''
  and no bytes), so the sampled token's entry and its copy in ``top`` agree.
  A token whose log probability did not arrive gets no entry.
- Reasoning (``DetokRequest.split``, filled by the tokenizer stage): the thinking
  block starts and ends on token ids. It opens when the prompt already opened it
  (``in_reasoning``) or on the start token before any non-blank answer text, at
  most once; it closes on the end token. Its text has its own decoder and no stop
  matcher (stop strings apply to the answer only) and goes to ``reasoning_text``;
  its tokens' entries to ``reasoning_logprobs``. The two tag tokens are markup:
  in ``token_ids``, in neither text nor either log-probability list. With
  ``drop_reasoning`` the block's text and entries are never sent.
- Tool calls (``split.tool_parser``): the answer, after the stop matcher, goes
  through a HeldCallStream; its content deltas go out as ``text``, whole calls at
  finish as ``tool_calls`` with finish_reason "tool_calls". Held text keeps its
  tokens held; when calls parse, the answer's entries still cover the call text.
  A syntax's tags (parser ``tags``) that the checkpoint holds as special tokens are
  answer text for such a request even under skip_special_tokens (text, bytes and
  log-probability entries alike): the parser must see ``<tool_call>`` to find a call.
- ``echo_text`` (completions ``echo``) is prepended to the first output, outside
  the stop matcher and the log-probability alignment.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Optional

from ..errors import PocketLLMError
from ..proto.messages import (DetokRequest, ErrorDetail, ErrorKind, LogprobEntry, RequestOutput,
                              SamplingSpec, TokenBatch, TokenDelta, TokenLogprobs, ToolCallOut,
                              Usage)
from .incremental import IncrementalDecoder
from .stop import StopMatcher
from .token_bytes import TokenSurface


log = logging.getLogger(__name__)

ANSWER, REASONING, TAG = "answer", "reasoning", "tag"  # what a generated token belongs to


@dataclass
class _HeldToken:
    token_id: int
    byte_start: int  # offsets in the concatenated bytes of its part's (answer / reasoning) tokens
    byte_end: int
    logprobs: Optional[TokenLogprobs]
    part: str = ANSWER


class _RequestState:
    def __init__(self, req: DetokRequest, tokenizer, surface: TokenSurface) -> None:
        sampling: SamplingSpec = req.sampling
        self.request_id = req.request_id
        self.prompt_len = req.prompt_len
        self.skip_special = sampling.skip_special_tokens
        self.want_logprobs = sampling.logprobs is not None
        self.decoder = IncrementalDecoder(tokenizer, surface, self.skip_special)
        self.visible: frozenset[int] = frozenset()  # special ids the answer shows as text
        self.stop = StopMatcher(sampling.stop, sampling.include_stop_str_in_output)
        self.held_tokens: deque[_HeldToken] = deque()
        self.token_bytes = 0  # bytes of all shown tokens so far
        self.released_bytes = 0  # UTF-8 length of the text released so far
        self.answer_bytes = 0  # ... of the answer the stop matcher let through (before tool hold)
        self.num_generated = 0
        self.num_cached = 0
        self.echo_text = req.echo_text
        # reasoning block (see the module docstring)
        self.split = req.split
        self.in_reasoning = False
        self.reasoning_seen = False  # opened once: a later start token is plain answer
        self.answer_blank = True  # no answer text but whitespace yet
        self.rdecoder: Optional[IncrementalDecoder] = None
        self.r_token_bytes = 0
        self.r_released_bytes = 0
        self._tokenizer, self._surface_ref = tokenizer, surface
        if req.split is not None and req.split.in_reasoning:
            self._open_reasoning(tokenizer, surface)
        self.tools = None
        self.tool_calls: list[ToolCallOut] = []
        if req.split is not None and req.split.tool_parser:
            from ..protocol.tool_parsers import HeldCallStream, get_tool_parser

            try:
                parser = get_tool_parser(req.split.tool_parser)
                self.tools = HeldCallStream(parser, req.split.tools)
            except PocketLLMError as e:  # the tokenizer stage validates tools; never crash here
                log.warning("request %s: tool calls left in content: %s", self.request_id, e)
            else:
                # tags the checkpoint holds as special tokens must still reach the parser
                self.visible = surface.special_ids_of(parser.tags)
                if self.visible and self.skip_special:
                    self.decoder = IncrementalDecoder(tokenizer, surface, True, self.visible)

    def skip_for(self, token_id: int) -> bool:
        """skip_special_tokens for one answer token (a visible tag is text)."""
        return self.skip_special and token_id not in self.visible

    def _open_reasoning(self, tokenizer, surface: TokenSurface) -> None:
        self.in_reasoning = self.reasoning_seen = True
        self.rdecoder = IncrementalDecoder(tokenizer, surface, self.skip_special)

    def route(self, token_id: int) -> str:
        """Which part a generated token belongs to; opens and closes the block."""
        split = self.split
        if split is None or split.reasoning_start_id is None:
            return ANSWER
        if self.in_reasoning:
            if token_id == split.reasoning_end_id:
                self.in_reasoning = False
                return TAG
            return REASONING
        if token_id == split.reasoning_start_id and not self.reasoning_seen and self.answer_blank:
            self._open_reasoning(self._tokenizer, self._surface_ref)
            return TAG
        return ANSWER

    def reasoning_rest(self) -> str:
        """The block ended (its end token, or the request): the text its decoder still owes."""
        rest = self.rdecoder.finish() if self.rdecoder is not None else ""
        self.r_released_bytes = self.r_token_bytes
        return rest

    def release_text(self, text: str) -> str:
        """Pass decoded text through the stop matcher (then the tool-call hold); returns
        what goes out now as content."""
        if text.strip():
            self.answer_blank = False
        return self._content(self.stop.push(text) if self.stop else text)

    def flush_text(self) -> str:
        return self._content(self.stop.flush() if self.stop else "")

    def _content(self, out: str) -> str:
        self.answer_bytes += len(out.encode("utf-8"))
        if self.tools is not None and out:
            out = "".join(d.content for d in self.tools.feed(out) if d.content)
        self.released_bytes += len(out.encode("utf-8"))
        return out

    def finish_tools(self) -> str:
        """The answer is complete: the tool stream's last content; parsed calls are kept."""
        if self.tools is None:
            return ""
        pieces = []
        for d in self.tools.finish():
            if d.tool_call is not None:
                fn = d.tool_call["function"]
                self.tool_calls.append(ToolCallOut(d.tool_call["id"], fn["name"],
                                                   fn["arguments"]))
            elif d.content:
                pieces.append(d.content)
        return "".join(pieces)


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._surface = TokenSurface(tokenizer)
        self._requests: dict[str, _RequestState] = {}

    def num_active(self) -> int:
        return len(self._requests)

    def forget(self, request_id: str) -> None:
        """Drop a request's state (it failed outside ``process``)."""
        self._requests.pop(request_id, None)

    def process(self, batch: TokenBatch) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs for the frontend and the ids the scheduler must stop (a stop
        string matched, or the request failed here). One request's failure ends that
        request alone: it gets a final error output and its state is freed."""
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        finished_upstream = {d.request_id for d in batch.deltas if d.finish_reason is not None}
        for req in batch.new_requests:
            try:
                self._requests[req.request_id] = _RequestState(req, self._tokenizer,
                                                               self._surface)
            except Exception as e:  # noqa: BLE001
                outputs.append(self._failed(req.request_id, "set up", e))
                if req.request_id not in finished_upstream:
                    stopped.append(req.request_id)
        for delta in batch.deltas:
            state = self._requests.get(delta.request_id)
            if state is None:
                continue
            try:
                out = self._apply(state, delta)
            except Exception as e:  # noqa: BLE001
                out = self._failed(delta.request_id, "decode", e)
            outputs.append(out)
            if out.finished:
                del self._requests[delta.request_id]
                if delta.finish_reason is None:  # finished here: the scheduler must stop too
                    stopped.append(delta.request_id)
        return outputs, stopped

    @staticmethod
    def _failed(request_id: str, what: str, e: Exception) -> RequestOutput:
        log.exception("request %s: the detokenizer could not %s it", request_id, what)
        return RequestOutput(request_id=request_id, text="", token_ids=[], finished=True,
                             finish_reason="error", error=ErrorDetail(
                                 ErrorKind.internal, f"the detokenizer could not {what} this "
                                 f"request's output: {type(e).__name__}: {e}"))

    def _apply(self, state: _RequestState, delta: TokenDelta) -> RequestOutput:
        state.num_generated += len(delta.token_ids) + getattr(delta, "num_hidden_tokens", 0)
        state.num_cached = max(state.num_cached, delta.num_cached_tokens)
        pieces: list[str] = []
        rpieces: list[str] = []  # reasoning text
        for i, token_id in enumerate(delta.token_ids):
            logprobs = delta.logprobs[i] if i < len(delta.logprobs) else None
            part = state.route(token_id)
            if part == TAG:  # markup: no text; a closing tag flushes the block's decoder
                state.held_tokens.append(_HeldToken(token_id, 0, 0, logprobs, TAG))
                if not state.in_reasoning:
                    rpieces.append(state.reasoning_rest())
                continue
            nbytes = len(self._surface.token_bytes(
                token_id, state.skip_special if part == REASONING else state.skip_for(token_id)))
            if part == REASONING:
                state.held_tokens.append(_HeldToken(token_id, state.r_token_bytes,
                                                    state.r_token_bytes + nbytes, logprobs,
                                                    REASONING))
                state.r_token_bytes += nbytes
                text = state.rdecoder.add(token_id)
                if text:
                    rpieces.append(text)
                    state.r_released_bytes += len(text.encode("utf-8"))
                continue
            state.held_tokens.append(_HeldToken(token_id, state.token_bytes,
                                                state.token_bytes + nbytes, logprobs))
            state.token_bytes += nbytes
            text = state.decoder.add(token_id)
            if text:
                pieces.append(state.release_text(text))
            if state.stop.matched is not None:
                break  # later tokens of this delta are past the answer
        finish_reason = delta.finish_reason
        if state.stop.matched is None and finish_reason is not None:
            if state.in_reasoning:  # the request ended inside the block
                rpieces.append(state.reasoning_rest())
            rest = state.decoder.finish()
            if rest:
                pieces.append(state.release_text(rest))
            if state.stop.matched is None:
                pieces.append(state.flush_text())
        if state.stop.matched is not None and finish_reason != "error":
            finish_reason = "stop"  # the answer ended at a stop string (an error still wins)
        finished = finish_reason is not None
        if finished and state.tools is not None:
            pieces.append(state.finish_tools())
            if state.tool_calls and finish_reason not in ("error", "abort"):
                finish_reason = "tool_calls"
        token_ids, entries, rentries = self._release_tokens(state, finished)
        text = "".join(pieces)
        if state.echo_text:  # completions echo: the prompt leads the first output
            text, state.echo_text = state.echo_text + text, ""
        drop = state.split is not None and state.split.drop_reasoning
        return RequestOutput(
            request_id=state.request_id, text=text, token_ids=token_ids,
            finished=finished, finish_reason=finish_reason,
            usage=Usage(prompt_tokens=state.prompt_len, completion_tokens=state.num_generated,
                        cached_tokens=state.num_cached) if finished else None,
            logprobs=entries, reasoning_text="" if drop else "".join(rpieces),
            tool_calls=state.tool_calls if finished else [],
            reasoning_logprobs=[] if drop else rentries,
            error=delta.error if finish_reason == "error" else None)

    def _release_tokens(self, state: _RequestState, finished: bool
                        ) -> tuple[list[int], list[LogprobEntry], list[LogprobEntry]]:
        """Pop the held tokens whose bytes are all released (at finish: all that are kept).

        Returns the ids, the answer's entries and the reasoning block's entries.
        """
        cut = state.stop.matched is not None
        limit = state.answer_bytes if cut else state.released_bytes
        token_ids: list[int] = []
        entries: list[LogprobEntry] = []
        rentries: list[LogprobEntry] = []
        held = state.held_tokens
        while held:
            tok = held[0]
            if tok.part != ANSWER:
                # the block precedes the answer; its text only waits for UTF-8 completion
                if (tok.part == REASONING and not finished and state.in_reasoning
                        and tok.byte_end > state.r_released_bytes):
                    break
                held.popleft()
                token_ids.append(tok.token_id)
                if tok.part == REASONING and state.want_logprobs and tok.logprobs is not None:
                    rentries.append(self._entry(tok.token_id, tok.logprobs, state.skip_special,
                                                None))
                continue
            if cut:
                # keep a token when any of its bytes is in the answer (or it has none, here)
                if not (tok.byte_start < limit
                        or (tok.byte_start == tok.byte_end and tok.byte_start <= limit)):
                    break
            elif not finished and tok.byte_end > limit:
                break
            held.popleft()
            token_ids.append(tok.token_id)
            if state.want_logprobs and tok.logprobs is not None:
                keep = limit - tok.byte_start if cut and tok.byte_end > limit else None
                entries.append(self._entry(tok.token_id, tok.logprobs, state.skip_special, keep,
                                           state.visible))
        if finished:
            held.clear()
        return token_ids, entries, rentries

    def _entry(self, token_id: int, lp: TokenLogprobs, skip: bool,
               keep_bytes: Optional[int], visible: frozenset[int] = frozenset()) -> LogprobEntry:
        top = [self._plain_entry(alt, alt_lp, skip and alt not in visible)
               for alt, alt_lp in zip(lp.top_token_ids, lp.top_logprobs)]
        entry = self._plain_entry(token_id, lp.logprob, skip and token_id not in visible)
        entry.top = top
        if keep_bytes is not None:  # a stop string cut through this token
            kept = bytes(entry.bytes[:max(keep_bytes, 0)])
            entry.bytes = list(kept)
            entry.token = kept.decode("utf-8", errors="replace")
        return entry

    def _plain_entry(self, token_id: int, logprob: float, skip: bool) -> LogprobEntry:
        return LogprobEntry(token_id=token_id, token=self._surface.token_text(token_id, skip),
                            bytes=list(self._surface.token_bytes(token_id, skip)),
                            logprob=logprob)

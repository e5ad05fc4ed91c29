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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from ..proto.messages import (DetokRequest, LogprobEntry, RequestOutput, SamplingSpec,
                              TokenBatch, TokenDelta, TokenLogprobs, Usage)
from .incremental import IncrementalDecoder
from .stop import StopMatcher
from .token_bytes import TokenSurface


@dataclass
class _HeldToken:
    token_id: int
    byte_start: int  # offsets in the concatenated bytes of this request's shown tokens
    byte_end: int
    logprobs: Optional[TokenLogprobs]


class _RequestState:
    def __init__(self, req: DetokRequest, tokenizer, surface: TokenSurface) -> None:
        sampling: SamplingSpec = req.sampling
        self.request_id = req.request_id
        self.prompt_len = req.prompt_len
        self.skip_special = sampling.skip_special_tokens
        self.want_logprobs = sampling.logprobs is not None
        self.decoder = IncrementalDecoder(tokenizer, surface, self.skip_special)
        self.stop = StopMatcher(sampling.stop, sampling.include_stop_str_in_output)
        self.held_tokens: deque[_HeldToken] = deque()
        self.token_bytes = 0  # bytes of all shown tokens so far
        self.released_bytes = 0  # UTF-8 length of the text released so far
        self.num_generated = 0
        self.num_cached = 0

    def release_text(self, text: str) -> str:
        """Pass decoded text through the stop matcher; returns what goes out now."""
        out = self.stop.push(text) if self.stop else text
        self.released_bytes += len(out.encode("utf-8"))
        return out

    def flush_text(self) -> str:
        out = self.stop.flush() if self.stop else ""
        self.released_bytes += len(out.encode("utf-8"))
        return out


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._surface = TokenSurface(tokenizer)
        self._requests: dict[str, _RequestState] = {}

    def num_active(self) -> int:
        return len(self._requests)

    def process(self, batch: TokenBatch) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs for the frontend and the ids whose stop string matched."""
        for req in batch.new_requests:
            self._requests[req.request_id] = _RequestState(req, self._tokenizer, self._surface)
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        for delta in batch.deltas:
            state = self._requests.get(delta.request_id)
            if state is None:
                continue
            out = self._apply(state, delta)
            outputs.append(out)
            if out.finished:
                del self._requests[delta.request_id]
                if delta.finish_reason is None:  # finished here: the scheduler must stop too
                    stopped.append(delta.request_id)
        return outputs, stopped

    def _apply(self, state: _RequestState, delta: TokenDelta) -> RequestOutput:
        state.num_generated += len(delta.token_ids) + getattr(delta, "num_hidden_tokens", 0)
        state.num_cached = max(state.num_cached, delta.num_cached_tokens)
        pieces: list[str] = []
        for i, token_id in enumerate(delta.token_ids):
            nbytes = len(self._surface.token_bytes(token_id, state.skip_special))
            logprobs = delta.logprobs[i] if i < len(delta.logprobs) else None
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
            rest = state.decoder.finish()
            if rest:
                pieces.append(state.release_text(rest))
            if state.stop.matched is None:
                pieces.append(state.flush_text())
        if state.stop.matched is not None and finish_reason != "error":
            finish_reason = "stop"  # the answer ended at a stop string (an error still wins)
        finished = finish_reason is not None
        token_ids, entries = self._release_tokens(state, finished)
        return RequestOutput(
            request_id=state.request_id, text="".join(pieces), token_ids=token_ids,
            finished=finished, finish_reason=finish_reason,
            usage=Usage(prompt_tokens=state.prompt_len, completion_tokens=state.num_generated,
                        cached_tokens=state.num_cached) if finished else None,
            logprobs=entries)

    def _release_tokens(self, state: _RequestState,
                        finished: bool) -> tuple[list[int], list[LogprobEntry]]:
        """Pop the held tokens whose bytes are all released (at finish: all that are kept)."""
        cut = state.stop.matched is not None
        limit = state.released_bytes
        token_ids: list[int] = []
        entries: list[LogprobEntry] = []
        held = state.held_tokens
        while held:
            tok = held[0]
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
                entries.append(self._entry(tok.token_id, tok.logprobs, state.skip_special, keep))
        if finished:
            held.clear()
        return token_ids, entries

    def _entry(self, token_id: int, lp: TokenLogprobs, skip: bool,
               keep_bytes: Optional[int]) -> LogprobEntry:
        top = [self._plain_entry(alt, alt_lp, skip)
               for alt, alt_lp in zip(lp.top_token_ids, lp.top_logprobs)]
        entry = self._plain_entry(token_id, lp.logprob, skip)
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

"""Incremental detokenization of one request's generated tokens.

Invariant: the concatenation of every piece ``add`` and ``finish`` return equals
``tokenizer.decode(all ids, skip_special_tokens=...)``. Each step costs a decode
of a small window, never of the whole text:

- The window is ``ids[prefix:]``. The text of ``ids[prefix:read]`` was already
  returned; decoding it again beside the new tokens gives the decoder the context
  it needs (a SentencePiece decoder treats the first token of a call differently)
  and the difference is the new text.
- The text is held (nothing returned, offsets unchanged) while the window ends
  in U+FFFD for a UTF-8 sequence that a later token can still complete. With an
  exact byte table (see token_bytes) that is decided from the raw bytes, so a
  U+FFFD the text really contains (an invalid byte, or the character itself) is
  not held forever; without one, any trailing U+FFFD is held until finish.
- A SentencePiece ``ByteFallback`` decoder decodes a run of ``<0xNN>`` tokens as a
  whole and turns *every* byte of an invalid run into U+FFFD, so a valid prefix
  of a run is not final until the run ends. An open run is held until a
  non-byte token closes it, up to ``MAX_HELD_BYTE_RUN`` tokens (a bound on latency
  and cost; past it the valid text is released and the invariant can break for an
  invalid run longer than that, which real models do not produce).
- Special tokens the request skips are not part of the window at all (the
  tokenizer drops them before its decoder runs, so this changes nothing). ``visible``
  special ids are the exception: they stay in the window and decode as their text.
- ``finish`` decodes everything once and returns whatever the stream still owes;
  if the incremental text is not a prefix of the full decode (an exotic decoder),
  it logs a warning and returns the incremental remainder instead.
"""

from __future__ import annotations

import codecs
import logging

from .token_bytes import TokenSurface

log = logging.getLogger(__name__)

MAX_HELD_BYTE_RUN = 32
_REPLACEMENT = "\ufffd"


def ends_inside_utf8_sequence(data: bytes) -> bool:
    """True when ``data`` ends with the start of a UTF-8 sequence that more bytes can complete."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data[-4:], final=False)
    return bool(decoder.getstate()[0])


class IncrementalDecoder:
    def __init__(self, tokenizer, surface: TokenSurface, skip_special_tokens: bool,
                 visible: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._surface = surface
        self._skip = skip_special_tokens
        # special ids decoded as text even when skipped (the tool-call tags: the parser needs
        # them); the others never enter the window, so the window decodes with skip off
        self._visible = visible if skip_special_tokens else frozenset()
        self._ids: list[int] = []  # the ids that reach the decoder (skipped specials left out)
        self._prefix = 0  # ids[prefix:read] is context whose text was already returned
        self._read = 0
        self._prefix_text = ""  # decode(ids[prefix:read])
        self._returned: list[str] = []  # every piece returned, joined only at finish

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip and not self._visible)

    def _skips(self, token_id: int) -> bool:
        return token_id not in self._visible and self._surface.is_skipped(token_id, self._skip)

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the text that is now final (often '' or one token's)."""
        if self._skips(token_id):
            return ""
        self._ids.append(token_id)
        pending = len(self._ids) - self._read
        if self._surface.is_byte_token(token_id) and pending < MAX_HELD_BYTE_RUN:
            return ""  # an open byte-fallback run: its text can still change
        window_text = self._decode(self._ids[self._prefix:])
        if window_text.endswith(_REPLACEMENT) and self._tail_is_incomplete():
            return ""
        if not window_text.startswith(self._prefix_text):
            log.debug("window text does not extend its prefix: %r / %r", window_text,
                      self._prefix_text)
        piece = window_text[len(self._prefix_text):]
        if not piece:
            return ""  # nothing visible yet: keep the context window as it is
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        self._returned.append(piece)
        return piece

    def _tail_is_incomplete(self) -> bool:
        if not self._surface.exact:
            return True
        tail_ids = self._ids[max(self._read, len(self._ids) - 4):]
        tail = b"".join(self._surface.token_bytes(t, self._skips(t)) for t in tail_ids)
        return ends_inside_utf8_sequence(tail)

    def finish(self) -> str:
        """Return the rest of the text once no more tokens will come (one full decode)."""
        returned = "".join(self._returned)
        full = self._decode(self._ids)
        if full.startswith(returned):
            rest = full[len(returned):]
        else:
            log.warning("incremental text diverged from the full decode; flushing the window")
            rest = self._decode(self._ids[self._prefix:])[len(self._prefix_text):]
        self._returned = [returned + rest]
        self._prefix = self._read = len(self._ids)
        self._prefix_text = ""
        return rest

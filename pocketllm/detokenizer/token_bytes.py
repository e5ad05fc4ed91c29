"""The exact bytes and the surface text of a single token.

A token's *surface text* is ``tokenizer.decode([id])``: a token holding one piece
of a multi-byte character decodes to U+FFFD, so its *bytes* are computed from the
vocabulary instead, following the tokenizer's own convention, detected once from
its decoder's JSON:

- ``byte_level`` (GPT-2 style, a ``ByteLevel`` decoder): each character of a
  vocabulary entry stands for one byte through the GPT-2 byte<->unicode table.
- ``sentencepiece`` (a ``Replace``/``Metaspace`` decoder and/or ``ByteFallback``):
  the meta space (U+2581) is a space and ``<0xNN>`` tokens are the byte NN.
- ``plain`` (anything else): the UTF-8 of the surface text; not exact for tokens
  that split a character (``exact`` is False so callers know).

Special tokens the request skips have no bytes (they are not in the text).
"""

from __future__ import annotations

import json
import re
from typing import Optional

from ..protocol.byte_level import CHAR_TO_BYTE

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _flatten_decoders(decoder: Optional[dict]) -> list[dict]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [d for sub in decoder.get("decoders", []) for d in _flatten_decoders(sub)]
    return [decoder]


class TokenSurface:
    """Per-token text and bytes for one tokenizer (cached; shared by all requests)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        # The decoder and the added tokens only: the whole tokenizer's JSON (to_str) holds
        # the vocabulary and merges, 12 MB for a 262k vocabulary, ~1 s to write and parse.
        decoder = tokenizer.decoder
        decoders = _flatten_decoders(json.loads(decoder.__getstate__()) if decoder else None)
        types = {d.get("type") for d in decoders}
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self._space_marks: list[str] = []  # characters a decoder turns into " "
        for d in decoders:
            if d.get("type") == "Replace" and d.get("content") == " ":
                pattern = d.get("pattern", {})
                if "String" in pattern:
                    self._space_marks.append(pattern["String"])
            elif d.get("type") == "Metaspace":
                self._space_marks.append(d.get("replacement", "\u2581"))
        self.byte_fallback = "ByteFallback" in types
        if "ByteLevel" in types:
            self.convention = "byte_level"
            self._unicode_to_byte = CHAR_TO_BYTE
        elif self.byte_fallback or self._space_marks:
            self.convention = "sentencepiece"
        else:
            self.convention = "plain"
        self.exact = self.convention != "plain"
        self._text_cache: dict[tuple[int, bool], str] = {}
        self._bytes_cache: dict[int, bytes] = {}
        self._byte_token_cache: dict[int, bool] = {}
        self._special_of_cache: dict[tuple[str, ...], frozenset[int]] = {}

    def special_ids_of(self, texts: tuple[str, ...]) -> frozenset[int]:
        """The ids of those texts that are one special token each (cached per tuple)."""
        hit = self._special_of_cache.get(texts)
        if hit is None:
            ids = (self._tokenizer.token_to_id(t) for t in texts)
            hit = frozenset(i for i in ids if i is not None and i in self.special_ids)
            self._special_of_cache[texts] = hit
        return hit

    def is_skipped(self, token_id: int, skip_special_tokens: bool) -> bool:
        return skip_special_tokens and token_id in self.special_ids

    def is_byte_token(self, token_id: int) -> bool:
        """True for a SentencePiece byte-fallback token such as ``<0xE2>``."""
        if not self.byte_fallback:
            return False
        hit = self._byte_token_cache.get(token_id)
        if hit is None:
            piece = self._tokenizer.id_to_token(token_id)
            hit = piece is not None and _BYTE_TOKEN.match(piece) is not None
            self._byte_token_cache[token_id] = hit
        return hit

    def token_text(self, token_id: int, skip_special_tokens: bool) -> str:
        key = (token_id, skip_special_tokens)
        text = self._text_cache.get(key)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)
            self._text_cache[key] = text
        return text

    def token_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes:
        if self.is_skipped(token_id, skip_special_tokens):
            return b""
        raw = self._bytes_cache.get(token_id)
        if raw is None:
            raw = self._compute_bytes(token_id)
            self._bytes_cache[token_id] = raw
        return raw

    def _compute_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None or self.convention == "plain":
            return self.token_text(token_id, False).encode("utf-8")
        if self.convention == "byte_level":
            table = self._unicode_to_byte
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode("utf-8")  # an added token written in plain text
        match = _BYTE_TOKEN.match(piece) if self.byte_fallback else None
        if match:
            return bytes([int(match.group(1), 16)])
        for mark in self._space_marks:
            piece = piece.replace(mark, " ")
        return piece.encode("utf-8")

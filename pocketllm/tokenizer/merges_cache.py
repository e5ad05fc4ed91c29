"""A SentencePiece vocabulary's tokens and recovered merges, kept on disk between starts.

Recovering the merges that can fire (``gguf_vocab._firing_merges``) costs ~1.9 s of CPU
for Gemma 3's 262k tokens, more than the tokenizer stage's whole start from the cache.
Decoding the tokens from the GGUF costs ~0.1 s more in each of the two stages that read
them (the tokenizer and the detokenizer). Reading both back costs ~0.1 s, the tokens
alone ~0.03 s. The file is
keyed by a digest of what they are computed from (the GGUF's token array as stored, and
how the merges are ranked), not by the checkpoint's path, so nothing is decoded to find
it; it is written whole or not at all (a temporary file renamed into place), and holds
plain text: a line that says how many tokens and merges follow and how many bytes the
tokens take, then the tokens, then each merge's two pieces, all NUL-separated. A missing,
unreadable or inconsistent file is recomputed; an unwritable cache directory only costs
the recomputation.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Optional

from ..gguf_meta import string_array_digest

_FORMAT = "pocketllm-vocab 3"
_SEP = "\x00"

Merges = list[tuple[str, str]]


def cache_dir() -> str:
    """``$POCKETLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pocketllm``, else ``~/.cache/pocketllm``."""
    return os.environ.get("POCKETLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pocketllm")


def vocab_key(tokens: Sequence[str], ranking: bytes) -> str:
    """The cache's name for a vocabulary: its GGUF token array (as the file stores it) and
    ``ranking``, what orders its merges (the scores' bytes, or a word for by position)."""
    digest = hashlib.sha256(_FORMAT.encode())
    digest.update(string_array_digest(tokens))
    digest.update(ranking)
    return digest.hexdigest()


def _path(key: str) -> str:
    return os.path.join(cache_dir(), "vocab", key + ".txt")


def _read(path: str, with_merges: bool) -> Optional[tuple[list[str], Merges]]:
    try:
        with open(path, "rb") as f:
            head, _, body = f.read().partition(b"\n")
        fields = head.split(b" ")
        if b" ".join(fields[:2]) != _FORMAT.encode() or len(fields) != 5:
            return None
        n_tokens, n_merges, token_bytes = map(int, fields[2:])
        if body[token_bytes:token_bytes + 1] != (_SEP.encode() if n_merges else b""):
            return None
        if not with_merges:  # only the tokens' bytes are decoded
            tokens = body[:token_bytes].decode("utf-8", "surrogatepass").split(_SEP)
            return (tokens, []) if len(tokens) == n_tokens else None
        parts = body.decode("utf-8", "surrogatepass").split(_SEP)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if len(parts) != n_tokens + 2 * n_merges:
        return None
    pieces = islice(parts, n_tokens, None)
    return parts[:n_tokens], list(zip(pieces, pieces))


def _write(path: str, tokens: list[str], merges: Merges) -> None:
    head = _SEP.join(tokens).encode("utf-8", "surrogatepass")
    body = _SEP.join(piece for pair in merges for piece in pair).encode("utf-8", "surrogatepass")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(f"{_FORMAT} {len(tokens)} {len(merges)} {len(head)}\n".encode())
                f.write(head + _SEP.encode() + body if merges else head)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def cached_vocabulary(key: str, decode: Callable[[], list[str]],
                      recover: Optional[Callable[[list[str]], Merges]] = None
                      ) -> tuple[list[str], Merges]:
    """(the tokens, their merges): ``decode()`` and ``recover(tokens)``, or both read from
    the cache when it holds them (``key``: ``vocab_key``). Without ``recover`` (a decoder,
    which reads no merges) only the tokens are read, and a vocabulary the cache lacks is
    decoded, not written."""
    path = _path(key)
    cached = _read(path, with_merges=recover is not None)
    if cached is not None:
        return cached
    tokens = decode()
    if recover is None:
        return tokens, []
    merges = recover(tokens)
    if not any(_SEP in t for t in tokens):  # the separator must not occur in a piece
        _write(path, tokens, merges)
    return tokens, merges

"""The merges recovered from a SentencePiece vocabulary, kept on disk between starts.

Recovering them (``gguf_vocab._merges_from_vocab``) costs ~1 s of CPU for Gemma 3's
262k tokens, half of the tokenizer stage's start and, on two cores shared by four
starting processes, the last thing before the engine is ready. Reading them back
costs ~0.15 s. The file is keyed by a digest of the tokens and their ranks (not by
the checkpoint's path), written whole or not at all (a temporary file renamed into
place), and holds plain text: each merge's two pieces, NUL-separated, after a line
that says how many merges follow. A missing, unreadable or inconsistent file is
recomputed; an unwritable cache directory only costs the recomputation.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from array import array
from collections.abc import Callable, Sequence

_FORMAT = "pocketllm-merges 1"
_SEP = "\x00"


def cache_dir() -> str:
    """``$POCKETLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pocketllm``, else ``~/.cache/pocketllm``."""
    return os.environ.get("POCKETLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pocketllm")


def _path(tokens: list[str], ranks: Sequence[float]) -> str:
    digest = hashlib.sha256(_SEP.join(tokens).encode("utf-8", "surrogatepass"))
    # the ranks' native float64 bytes, as numpy's tobytes() gave them: the same files hit
    digest.update(array("d", ranks).tobytes())
    return os.path.join(cache_dir(), "merges", digest.hexdigest() + ".txt")


def _read(path: str) -> list[tuple[str, str]] | None:
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "surrogatepass")
    except (OSError, UnicodeDecodeError):
        return None
    head, _, body = text.partition("\n")
    fmt, _, count = head.rpartition(" ")
    parts = body.split(_SEP) if body else []
    if fmt != _FORMAT or not count.isdigit() or len(parts) != 2 * int(count):
        return None
    pieces = iter(parts)
    return list(zip(pieces, pieces))


def _write(path: str, merges: list[tuple[str, str]]) -> None:
    body = _SEP.join(piece for pair in merges for piece in pair)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(f"{_FORMAT} {len(merges)}\n{body}".encode("utf-8", "surrogatepass"))
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def cached_merges(tokens: list[str], ranks: Sequence[float],
                  compute: Callable[[list[str], Sequence[float]], list[tuple[str, str]]]
                  ) -> list[tuple[str, str]]:
    """``compute(tokens, ranks)``, read from the cache when it holds them."""
    if any(_SEP in t for t in tokens):  # the separator must not occur in a piece
        return compute(tokens, ranks)
    path = _path(tokens, ranks)
    merges = _read(path)
    if merges is None:
        merges = compute(tokens, ranks)
        _write(path, merges)
    return merges

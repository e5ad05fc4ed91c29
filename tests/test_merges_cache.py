"""A SentencePiece vocabulary's tokens and recovered merges, cached on disk between starts:
what comes back equals what was computed, the tokens alone can be read back, and a bad or
unwritable cache costs only the recomputation."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pocketllm.gguf_meta import LazyStrings, string_array_digest
from pocketllm.tokenizer import merges_cache
from pocketllm.tokenizer.gguf_vocab import _firing_merges

TOKENS = ["a", "b", "c", "ab", "bc", "abc", "\u2581", "\u2581a", "\u2581ab", "\udcff", "\udcffa"]
RANKS = np.arange(len(TOKENS), dtype=np.float64)
KEY = merges_cache.vocab_key(TOKENS, b"position")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKETLLM_CACHE_DIR", str(tmp_path))
    return tmp_path


def counting(tokens=TOKENS, ranks=RANKS):
    calls = []

    def decode():
        calls.append("decode")
        return list(tokens)

    def recover(decoded):
        calls.append("recover")
        return _firing_merges(decoded, ranks)
    return decode, recover, calls


def expected(tokens=TOKENS, ranks=RANKS):
    return list(tokens), _firing_merges(list(tokens), ranks)


def test_second_read_comes_from_the_cache_and_equals_the_computation(cache):
    decode, recover, calls = counting()
    first = merges_cache.cached_vocabulary(KEY, decode, recover)
    assert first == expected() and ("a", "b") in first[1]
    assert merges_cache.cached_vocabulary(KEY, decode, recover) == first
    assert calls == ["decode", "recover"]
    # the tokens alone, for a decoder: read back, the merges left undecoded
    assert merges_cache.cached_vocabulary(KEY, decode) == (first[0], [])
    assert len(calls) == 2
    # other ranks are another vocabulary: computed anew, in their order
    other_ranks = RANKS[::-1].copy()
    decode, recover, calls = counting(ranks=other_ranks)
    other = merges_cache.cached_vocabulary(merges_cache.vocab_key(TOKENS, other_ranks.tobytes()),
                                           decode, recover)
    assert calls == ["decode", "recover"] and other == expected(ranks=other_ranks)


def test_a_decoder_never_writes_and_decodes_what_is_not_cached(cache):
    decode, recover, calls = counting()
    assert merges_cache.cached_vocabulary(KEY, decode) == (TOKENS, [])
    assert calls == ["decode"] and not (cache / "vocab").exists()


def test_a_truncated_or_foreign_file_is_recomputed(cache):
    decode, recover, calls = counting()
    merges_cache.cached_vocabulary(KEY, decode, recover)
    (path,) = (cache / "vocab").iterdir()
    data = path.read_bytes()
    head, _, body = data.partition(b"\n")
    for bad in (data[:-3], b"something else\n" + data, b"", head + b"\n" + body[:5],
                head.replace(b" 11 ", b" 12 ") + b"\n" + body):
        path.write_bytes(bad)
        assert merges_cache.cached_vocabulary(KEY, decode, recover) == expected()
        path.write_bytes(bad)
        assert merges_cache.cached_vocabulary(KEY, decode) == (TOKENS, [])
    # each bad file is recomputed, and rewritten, then read by a decoder: the cut in the
    # merges (the first) leaves its tokens readable, every other one is decoded anew
    assert len(calls) == 2 + 5 * 2 + 4
    merges_cache.cached_vocabulary(KEY, decode, recover)  # the last bad file, recomputed
    assert path.read_bytes() == data  # rewritten whole


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_an_unwritable_cache_only_costs_the_recomputation(cache):
    cache.chmod(0o500)
    try:
        decode, recover, calls = counting()
        for _ in range(2):
            assert merges_cache.cached_vocabulary(KEY, decode, recover) == expected()
        assert len(calls) == 4
    finally:
        cache.chmod(0o700)


def test_a_cache_path_that_is_a_file_only_costs_the_recomputation(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("POCKETLLM_CACHE_DIR", str(blocker))
    decode, recover, calls = counting()
    assert merges_cache.cached_vocabulary(KEY, decode, recover) == expected()
    assert len(calls) == 2


def test_a_vocabulary_holding_the_separator_is_never_cached(cache):
    tokens = TOKENS + ["x\x00y"]
    ranks = np.arange(len(tokens), dtype=np.float64)
    decode, recover, calls = counting(tokens, ranks)
    key = merges_cache.vocab_key(tokens, b"position")
    for _ in range(2):
        merges_cache.cached_vocabulary(key, decode, recover)
    assert len(calls) == 4 and not (cache / "vocab").exists()


def test_the_key_is_the_array_as_stored_whether_lazy_or_a_list():
    """The key hashes the GGUF's bytes, so finding the file decodes nothing: a long array
    (``LazyStrings``) and a short one (a list) of the same strings key alike."""
    raw = b"".join(len(t.encode("utf-8", "surrogatepass")).to_bytes(8, "little")
                   + t.encode("utf-8", "surrogatepass") for t in TOKENS)
    lazy = LazyStrings(raw, len(TOKENS))
    assert string_array_digest(lazy) == string_array_digest(TOKENS)
    assert repr(lazy).endswith("not decoded yet>")
    assert merges_cache.vocab_key(lazy, b"position") == KEY
    assert merges_cache.vocab_key(TOKENS, b"scores") != KEY
    assert merges_cache.vocab_key(TOKENS[:-1], b"position") != KEY

"""The merges recovered from a SentencePiece vocabulary, cached on disk between starts:
what comes back equals what was computed, and a bad or unwritable cache costs only the
recomputation."""

from __future__ import annotations

import os
from array import array

import numpy as np
import pytest

from pocketllm.tokenizer import merges_cache
from pocketllm.tokenizer.gguf_vocab import _merges_from_vocab

TOKENS = ["a", "b", "c", "ab", "bc", "abc", "\u2581", "\u2581a", "\u2581ab", "\udcff", "\udcffa"]
RANKS = np.arange(len(TOKENS), dtype=np.float64)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKETLLM_CACHE_DIR", str(tmp_path))
    return tmp_path


def counting():
    calls = []

    def compute(tokens, ranks):
        calls.append(1)
        return _merges_from_vocab(tokens, ranks)
    return compute, calls


def test_second_read_comes_from_the_cache_and_equals_the_computation(cache):
    compute, calls = counting()
    first = merges_cache.cached_merges(TOKENS, RANKS, compute)
    assert first == _merges_from_vocab(TOKENS, RANKS) and ("a", "b") in first
    assert merges_cache.cached_merges(TOKENS, RANKS, compute) == first
    assert len(calls) == 1
    # other ranks are another vocabulary: computed anew, in their order
    other = merges_cache.cached_merges(TOKENS, RANKS[::-1].copy(), compute)
    assert len(calls) == 2 and other == _merges_from_vocab(TOKENS, RANKS[::-1].copy())


def test_a_truncated_or_foreign_file_is_recomputed(cache):
    compute, calls = counting()
    merges_cache.cached_merges(TOKENS, RANKS, compute)
    (path,) = (cache / "merges").iterdir()
    data = path.read_bytes()
    for bad in (data[:-3], b"something else\n" + data, b""):
        path.write_bytes(bad)
        assert merges_cache.cached_merges(TOKENS, RANKS, compute) == _merges_from_vocab(TOKENS, RANKS)
    assert len(calls) == 4
    assert path.read_bytes() == data  # rewritten whole


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_an_unwritable_cache_only_costs_the_recomputation(cache):
    cache.chmod(0o500)
    try:
        compute, calls = counting()
        for _ in range(2):
            assert merges_cache.cached_merges(TOKENS, RANKS, compute) == _merges_from_vocab(TOKENS, RANKS)
        assert len(calls) == 2
    finally:
        cache.chmod(0o700)


def test_a_cache_path_that_is_a_file_only_costs_the_recomputation(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("POCKETLLM_CACHE_DIR", str(blocker))
    compute, calls = counting()
    assert merges_cache.cached_merges(TOKENS, RANKS, compute) == _merges_from_vocab(TOKENS, RANKS)
    assert len(calls) == 1


def test_a_vocabulary_holding_the_separator_is_never_cached(cache):
    tokens = TOKENS + ["x\x00y"]
    compute, calls = counting()
    for _ in range(2):
        merges_cache.cached_merges(tokens, np.arange(len(tokens), dtype=np.float64), compute)
    assert len(calls) == 2 and not (cache / "merges").exists()


def test_array_ranks_key_the_file_numpy_ranks_keyed():
    """The vocabulary passes its ranks as an array('d') (numpy stays unimported), numpy's
    float64 array before: the same bytes, so a cache written before is still found."""
    before = "4f2874d8258191af317577f8e7ab7288ca2df5768224def9270e25ce9224fa8e.txt"  # at 12c2f5b
    assert os.path.basename(merges_cache._path(TOKENS, RANKS)) == before
    assert os.path.basename(merges_cache._path(TOKENS, array("d", range(len(TOKENS))))) == before
    scores = [0.5, -1.0, 0.0, 2.0, -0.0, 3.25, 1e30, -7.0, 1.5, 0.125, 9.0]
    assert merges_cache._path(TOKENS, array("d", (-s for s in scores))) == \
           merges_cache._path(TOKENS, -np.asarray(scores, dtype=np.float64))

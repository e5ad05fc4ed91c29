"""Incremental detokenization: streamed text == full decode, at any chunking, on two tokenizers.

Tokenizers: the real Gemma 3 GGUF vocabulary (SentencePiece with byte fallback) and
a small byte-level BPE trained here (GPT-2 convention, tokens that split characters).
"""

from __future__ import annotations

import os

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pocketllm.detokenizer.detokenizer import Detokenizer
from pocketllm.detokenizer.incremental import IncrementalDecoder, ends_inside_utf8_sequence
from pocketllm.detokenizer.token_bytes import TokenSurface
from pocketllm.proto.messages import (DetokRequest, SamplingSpec, TokenBatch, TokenDelta,
                                      TokenLogprobs)

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def byte_level_bpe():
    """A deterministic GPT-2-style tokenizer whose merges split multi-byte characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>", "<sep>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = ["héllo wörld, naïve café costs 5€ today", "日本語のテキスト と 中文 文本",
              "emoji 😀🎉👍 party 🎉", "Привет мир, hello world",
              "the stop word STOP ends; ends and stops"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(["<think>"])  # an added, non-special token
    return tok


def _gemma_from_transformers(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path),
                                         gguf_file=os.path.basename(path)).backend_tokenizer


@pytest.fixture(scope="session")
def gemma_tokenizer(request, default_model_path):
    from tokenizers import Tokenizer

    path = default_model_path
    try:
        from pocketllm.tokenizer.gguf_vocab import tokenizer_from_gguf
        return tokenizer_from_gguf(path)
    except ImportError:
        pass
    # transformers takes ~20 s to build it: keep the result in pytest's cache between runs
    stat = os.stat(path)
    cache = getattr(request.config, "cache", None)
    if cache is None:
        return _gemma_from_transformers(path)
    cached = cache.mkdir("pocketllm-detok") / f"gemma-{stat.st_size}-{int(stat.st_mtime)}.json"
    if cached.exists():
        return Tokenizer.from_file(str(cached))
    tok = _gemma_from_transformers(path)
    tok.save(str(cached))
    return tok


@pytest.fixture(scope="module")
def bpe():
    tok = byte_level_bpe()
    return tok, Detokenizer(tok)


@pytest.fixture(scope="module")
def gemma(gemma_tokenizer):
    return gemma_tokenizer, Detokenizer(gemma_tokenizer)


_counter = iter(range(10**9))


def stream(detok, ids, chunks, skip_special=True, logprobs=None, hidden=1):
    """Feed ``ids`` in chunks of the given sizes; return every RequestOutput of the request."""
    rid = f"r{next(_counter)}"
    spec = SamplingSpec(skip_special_tokens=skip_special, logprobs=logprobs)
    batches, pos, sizes = [], 0, list(chunks) or [1]
    while pos < len(ids) or not batches:
        n = max(1, sizes[len(batches) % len(sizes)])
        part = ids[pos:pos + n]
        pos += len(part)
        lps = [TokenLogprobs(logprob=-0.5, top_token_ids=[t], top_logprobs=[-0.5]) for t in part]
        batches.append(TokenDelta(rid, part, logprobs=lps if logprobs is not None else []))
    batches[-1].finish_reason = "stop"
    batches[-1].num_hidden_tokens = hidden  # the EOS the scheduler removed
    outputs = []
    for i, delta in enumerate(batches):
        new = [DetokRequest(rid, prompt_len=7, sampling=spec)] if i == 0 else []
        outs, stopped = detok.process(TokenBatch(new_requests=new, deltas=[delta]))
        assert stopped == []
        assert [o.request_id for o in outs] == [rid]  # one output per delta, even if empty
        outputs += outs
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert detok.num_active() == 0
    return outputs


def check_stream(tokenizer, detok, ids, chunks, skip_special, logprobs):
    outputs = stream(detok, ids, chunks, skip_special, logprobs)
    text = "".join(o.text for o in outputs)
    assert text == tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert [t for o in outputs for t in o.token_ids] == ids
    final = outputs[-1]
    assert final.usage.completion_tokens == len(ids) + 1
    assert final.usage.prompt_tokens == 7
    if logprobs is not None:
        entries = [e for o in outputs for e in o.logprobs]
        assert [e.token_id for e in entries] == ids
        if "\ufffd" not in text:  # invalid bytes decode to U+FFFD: then text != token bytes
            assert b"".join(bytes(e.bytes) for e in entries) == text.encode("utf-8")
    return outputs


# ------------------------------------------------------------------ id strategies


def gemma_ids_strategy(tokenizer):
    byte_ids = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in
                (0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xC3, 0xA9, 0x41, 0xFF)]
    named = [tokenizer.token_to_id(t) for t in
             ("▁Hello", "▁", "▁▁", "Hello", "<eos>", "<start_of_turn>", "<pad>", "\n", "\n\n",
              "[multimodal]", "▁€", "語")]
    special = sorted(set(byte_ids + named))
    assert None not in special
    vocab = tokenizer.get_vocab_size()
    return st.lists(st.one_of(st.sampled_from(special), st.integers(0, vocab - 1)), max_size=40)


def bpe_ids_strategy(tokenizer):
    vocab = tokenizer.get_vocab_size()
    return st.lists(st.integers(0, vocab - 1), max_size=40)


CHUNKS = st.lists(st.integers(1, 6), min_size=1, max_size=5)


# ------------------------------------------------------------------ properties


@SETTINGS
@given(data=st.data(), chunks=CHUNKS, skip=st.booleans(), logprobs=st.sampled_from([None, 0]))
def test_gemma_random_ids_stream_equals_full_decode(gemma, data, chunks, skip, logprobs):
    tokenizer, detok = gemma
    ids = data.draw(gemma_ids_strategy(tokenizer))
    check_stream(tokenizer, detok, ids, chunks, skip, logprobs)


@pytest.fixture(scope="module")
def gemma_decode_only(default_model_path):
    """The detokenizer stage's own: the GGUF vocabulary without the model (``decode_only``)."""
    from pocketllm.tokenizer.gguf_vocab import DecodeOnlyTokenizer, tokenizer_from_gguf

    tok = tokenizer_from_gguf(default_model_path, decode_only=True)
    assert isinstance(tok, DecodeOnlyTokenizer)
    return tok, Detokenizer(tok)


@SETTINGS
@given(data=st.data(), chunks=CHUNKS, skip=st.booleans(), logprobs=st.sampled_from([None, 0]))
def test_gemma_decode_only_streams_as_the_full_tokenizer(gemma, gemma_decode_only, data, chunks,
                                                         skip, logprobs):
    ids = data.draw(gemma_ids_strategy(gemma[0]))
    full, lean = (stream(detok, ids, chunks, skip, logprobs)
                  for detok in (gemma[1], gemma_decode_only[1]))
    assert [msgspec.structs.replace(o, request_id="") for o in lean] == \
           [msgspec.structs.replace(o, request_id="") for o in full]


@SETTINGS
@given(data=st.data(), chunks=CHUNKS, skip=st.booleans(), logprobs=st.sampled_from([None, 2]))
def test_bpe_random_ids_stream_equals_full_decode(bpe, data, chunks, skip, logprobs):
    tokenizer, detok = bpe
    ids = data.draw(bpe_ids_strategy(tokenizer))
    check_stream(tokenizer, detok, ids, chunks, skip, logprobs)


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30) | st.sampled_from(
    ["naïve café 5€", "😀🎉 日本語", "𝄞 music ǅ", "Привет, мир!\n\n  x", "\U0001F9D1\u200d\U0001F4BB"])


@SETTINGS
@given(text=TEXT, chunks=CHUNKS)
def test_logprob_bytes_reassemble_the_answer(gemma, bpe, text, chunks):
    for tokenizer, detok in (gemma, bpe):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        outputs = check_stream(tokenizer, detok, ids, chunks, True, 1)
        answer = "".join(o.text for o in outputs)
        entries = [e for o in outputs for e in o.logprobs]
        assert b"".join(bytes(e.bytes) for e in entries) == answer.encode("utf-8")
        for e in entries:  # the alternative is the token itself, written the same way
            assert (e.top[0].token, e.top[0].bytes) == (e.token, e.bytes)


# ------------------------------------------------------------------ specific cases


def test_gemma_byte_fallback_character_is_never_split(gemma):
    tokenizer, detok = gemma
    b = [tokenizer.token_to_id(f"<0x{x:02X}>") for x in (0xE2, 0x82, 0xAC)]  # "€"
    ids = [tokenizer.token_to_id("▁Hello")] + b + [tokenizer.token_to_id("▁world")]
    outputs = stream(detok, ids, [1], logprobs=0)
    texts = [o.text for o in outputs]
    assert texts == [" Hello", "", "", "", "€ world"]
    assert all("\ufffd" not in t for t in texts)
    # the bytes ride with the text: byte tokens are released with the character
    assert [o.token_ids for o in outputs] == [ids[:1], [], [], [], ids[1:]]
    entries = [e for o in outputs for e in o.logprobs]
    assert [e.bytes for e in entries[1:4]] == [[0xE2], [0x82], [0xAC]]
    assert entries[1].token == "\ufffd"  # surface of half a character, as the tokenizer says


def test_bpe_split_emoji_and_leading_space(bpe):
    tokenizer, detok = bpe
    ids = tokenizer.encode("party 😀🎉 héllo").ids
    outputs = check_stream(tokenizer, detok, ids, [1], True, 0)
    assert all("\ufffd" not in o.text for o in outputs)
    assert any(o.text == "" for o in outputs)  # some token held half an emoji


def test_genuine_replacement_character_is_not_held(gemma, bpe):
    """An invalid byte run decodes to U+FFFD for good: released when it ends, not at finish."""
    tokenizer, detok = gemma
    bad = [tokenizer.token_to_id("<0xFF>"), tokenizer.token_to_id("▁x"),
           tokenizer.token_to_id("▁y")]
    outputs = stream(detok, bad, [1])
    assert [o.text for o in outputs] == ["", "\ufffd x", " y"]
    # the character U+FFFD itself (a Gemma token), and an invalid byte of a byte-level BPE
    literal = [tokenizer.token_to_id("▁�"), tokenizer.token_to_id("▁y")]
    assert [o.text for o in stream(detok, literal, [1])] == [" \ufffd", " y"]
    tokenizer, detok = bpe
    invalid = [tokenizer.token_to_id("ÿ"), tokenizer.token_to_id("a")]  # the byte 0xFF
    assert [o.text for o in stream(detok, invalid, [1])] == ["\ufffd", "a"]


def test_window_stays_small_on_long_output(gemma):
    """Per-token cost: each decode call sees a few tokens, not the whole answer."""
    tokenizer, _ = gemma
    sizes: list[int] = []

    class Spy:
        def decode(self, ids, skip_special_tokens=True):
            sizes.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "A long answer with émojis 😀 and 日本語 text, repeated. " * 60
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > 800
    decoder = IncrementalDecoder(Spy(), TokenSurface(tokenizer), skip_special_tokens=True)
    pieces = [decoder.add(t) for t in ids]
    assert max(sizes) <= 8
    pieces.append(decoder.finish())  # the one full decode, at the end
    assert "".join(pieces) == tokenizer.decode(ids)


def test_token_surface_conventions(gemma, bpe):
    g = TokenSurface(gemma[0])
    b = TokenSurface(bpe[0])
    assert (g.convention, b.convention) == ("sentencepiece", "byte_level")
    assert g.token_bytes(gemma[0].token_to_id("▁Hello"), True) == b" Hello"
    assert g.token_bytes(gemma[0].token_to_id("<0xE2>"), True) == b"\xe2"
    assert g.token_bytes(gemma[0].token_to_id("<eos>"), True) == b""
    assert g.token_bytes(gemma[0].token_to_id("<eos>"), False) == b"<eos>"
    assert b.token_bytes(bpe[0].token_to_id("ĠðŁ"), True) == b" \xf0\x9f"
    assert b.token_bytes(bpe[0].token_to_id("<think>"), True) == b"<think>"
    for tokenizer, surface in ((gemma[0], g), (bpe[0], b)):
        for token_id in range(0, tokenizer.get_vocab_size(), 7):  # every valid token agrees
            raw = surface.token_bytes(token_id, False)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            assert text == tokenizer.decode([token_id], skip_special_tokens=False), token_id


def test_ends_inside_utf8_sequence():
    assert ends_inside_utf8_sequence(b"a\xe2\x82")
    assert ends_inside_utf8_sequence(b"\xf0")
    assert not ends_inside_utf8_sequence(b"a\xe2\x82\xac")
    assert not ends_inside_utf8_sequence(b"\xff")
    assert not ends_inside_utf8_sequence(b"\xe0\x80")  # invalid already: nothing can complete it
    assert not ends_inside_utf8_sequence(b"")


def test_gemma_stop_string_inside_a_byte_fallback_run(gemma):
    """A stop string that starts in the middle of a byte run: cut on the character boundary."""
    tokenizer, detok = gemma
    ids = tokenizer.encode("ok 🦩🦩 done", add_special_tokens=False).ids
    assert len(ids) == 11  # ok ▁ + 8 byte tokens + ▁done
    for per_batch in (1, len(ids)):
        spec = SamplingSpec(stop=["🦩 d"], logprobs=0)
        deltas = [TokenDelta("g", ids[i:i + per_batch],
                             logprobs=[TokenLogprobs(-0.1)] * len(ids[i:i + per_batch]))
                  for i in range(0, len(ids), per_batch)]
        outputs, stopped = [], []
        for i, delta in enumerate(deltas):
            new = [DetokRequest("g", 1, spec)] if i == 0 else []
            outs, ids_stopped = detok.process(TokenBatch(new_requests=new, deltas=[delta]))
            outputs += outs
            stopped += ids_stopped
        assert "".join(o.text for o in outputs) == "ok 🦩"
        assert outputs[-1].finish_reason == "stop" and stopped == ["g"]
        assert [t for o in outputs for t in o.token_ids] == ids[:6]  # the second 🦩 is cut
        entries = [e for o in outputs for e in o.logprobs]
        assert b"".join(bytes(e.bytes) for e in entries) == "ok 🦩".encode()
        assert detok.num_active() == 0

"""Stop strings: the matcher alone, then through the Detokenizer (streamed and not), state lifetime."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pocketllm.detokenizer.detokenizer import Detokenizer
from pocketllm.detokenizer.stop import StopMatcher
from pocketllm.detokenizer.token_bytes import TokenSurface
from pocketllm.proto.messages import (DetokRequest, ErrorDetail, SamplingSpec, TokenBatch, TokenDelta,
                                      TokenLogprobs)
from test_detok_incremental import byte_level_bpe

# ------------------------------------------------------------------ the matcher alone


def push_all(matcher: StopMatcher, chunks: list[str]) -> tuple[list[str], bool]:
    out = []
    for chunk in chunks:
        out.append(matcher.push(chunk))
        if matcher.matched is not None:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_hold_back_releases_when_the_match_fails():
    m = StopMatcher(["STOP"])
    assert m.push("I will ST") == "I will "
    assert m.held == "ST"
    assert m.push("ay") == "STay"
    assert m.held == ""
    assert m.push("S") == ""
    assert m.flush() == "S"


def test_match_across_pushes_and_include():
    m = StopMatcher(["STOP"])
    assert (m.push("go S"), m.push("TO"), m.push("P now")) == ("go ", "", "")
    assert m.matched == "STOP"
    with pytest.raises(RuntimeError):
        m.push("more")
    m = StopMatcher(["STOP"], include_stop_str_in_output=True)
    assert m.push("go ST") == "go "
    assert m.push("OP now") == "STOP"


def test_first_completed_match_wins_and_empty_strings_are_ignored():
    m = StopMatcher(["", "abcd", "c"])
    assert m.push("xabcd") == "xab" and m.matched == "c"  # "c" completes before "abcd"
    m = StopMatcher(["bc", "abc"])
    assert m.push("xabc") == "x" and m.matched == "abc"  # same end: the earlier start
    m = StopMatcher(["", ""])
    assert not m and m.push("anything") == "anything"


def test_unicode_stop_strings():
    m = StopMatcher(["日本", "€€"])
    assert m.push("price 5€") == "price 5"
    assert m.push("€ and 日本語") == ""  # "€€" completed first, text after it is gone
    assert m.matched == "€€"


def reference_answer(text: str, stops: list[str], include: bool) -> tuple[str, bool]:
    """The cut on the whole text at once: the first match completed reading left to right."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
    if not found:
        return text, False
    end, start, _ = min(found)
    return text[:end] if include else text[:start], True


ALPHABET = st.text("ab€c", max_size=4)


@settings(max_examples=300, deadline=None)
@given(text=st.text("ab€c", max_size=25), stops=st.lists(ALPHABET, max_size=3),
       cuts=st.lists(st.integers(0, 25), max_size=6), include=st.booleans())
def test_matcher_is_independent_of_chunking(text, stops, cuts, include):
    bounds = sorted(set([0, len(text)] + [c for c in cuts if c <= len(text)]))
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    m = StopMatcher(stops, include)
    released = []
    for chunk in chunks:
        released.append(m.push(chunk))
        assert len(m.held) <= max([len(s) - 1 for s in stops] + [0])
        if m.matched is not None:
            break
        assert "".join(released) + m.held == text[:len("".join(released) + m.held)]
    matched = m.matched is not None
    if not matched:
        released.append(m.flush())
    assert ("".join(released), matched) == reference_answer(text, stops, include)


# ------------------------------------------------------------------ through the Detokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_level_bpe()


@pytest.fixture()
def detok(tok):
    return Detokenizer(tok)


def lp(token_id: int) -> TokenLogprobs:
    return TokenLogprobs(logprob=-1.0, top_token_ids=[token_id], top_logprobs=[-1.0])


def run(detok, tok, text, stop, per_batch=1, include=False, logprobs=None, finish="length",
        rid="req", hidden=0):
    """Generate ``text``'s tokens, ``per_batch`` per TokenDelta (0 = all in one)."""
    ids = tok.encode(text).ids
    spec = SamplingSpec(stop=stop, include_stop_str_in_output=include, logprobs=logprobs)
    size = per_batch or len(ids)
    parts = [ids[i:i + size] for i in range(0, len(ids), size)] or [[]]
    outputs, stopped = [], []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        delta = TokenDelta(rid, part, logprobs=[lp(t) for t in part] if logprobs is not None else [],
                           finish_reason=finish if last else None,
                           num_hidden_tokens=hidden if last else 0)
        new = [DetokRequest(rid, prompt_len=3, sampling=spec)] if i == 0 else []
        outs, stop_ids = detok.process(TokenBatch(new_requests=new, deltas=[delta]))
        outputs += outs
        stopped += stop_ids
    return ids, outputs, stopped


TEXT = "héllo wörld, the stop word STOP ends; 日本語のテキスト 😀🎉 party"


@pytest.mark.parametrize("stop,include,expected", [
    (["STOP"], False, "héllo wörld, the stop word "),
    (["STOP"], True, "héllo wörld, the stop word STOP"),
    (["ends", "stop w"], False, "héllo wörld, the "),  # earliest of several
    (["テキ"], False, "héllo wörld, the stop word STOP ends; 日本語の"),  # unicode, split tokens
    (["🎉"], True, "héllo wörld, the stop word STOP ends; 日本語のテキスト 😀🎉"),
    (["ld, t"], False, "héllo wör"),
])
def test_stop_string_streamed_and_not_agree(detok, tok, stop, include, expected):
    surface = TokenSurface(tok)
    results = []
    for per_batch in (1, 2, 0):
        ids, outputs, stopped = run(detok, tok, TEXT, stop, per_batch, include, logprobs=0,
                                    finish=None, rid=f"r{per_batch}")
        final = outputs[-1]
        text = "".join(o.text for o in outputs)
        assert text == expected
        assert final.finished and final.finish_reason == "stop"
        assert not any(o.finished for o in outputs[:-1])
        assert stopped == [f"r{per_batch}"]
        assert detok.num_active() == 0
        if not include:  # nothing of the stop string ever left, not even a streamed prefix
            assert stop[0] not in text and not text.endswith(stop[0][:1])
        token_ids = [t for o in outputs for t in o.token_ids]
        entries = [e for o in outputs for e in o.logprobs]
        assert [e.token_id for e in entries] == token_ids
        assert b"".join(bytes(e.bytes) for e in entries) == text.encode("utf-8")
        # kept tokens: exactly those with a byte in the answer
        assert token_ids == ids[:len(token_ids)]
        starts = [len(b"".join(surface.token_bytes(t, True) for t in ids[:i]))
                  for i in range(len(ids) + 1)]
        answer_bytes = len(text.encode("utf-8"))
        assert all(starts[i] < answer_bytes for i in range(len(token_ids)))
        assert len(token_ids) == len(ids) or starts[len(token_ids)] >= answer_bytes
        results.append((text, token_ids))
    assert results[0] == results[1] == results[2]


def test_hold_back_is_released_while_streaming(detok, tok):
    """Only the suffix that could still begin the stop string is withheld, at every step."""
    text = "the stop word STOP"  # ASCII: every token ends on a character boundary
    stop = "stop word X"
    ids, outputs, _ = run(detok, tok, text, [stop], per_batch=1)
    released = ""
    for k, out in enumerate(outputs[:-1]):
        released += out.text
        decoded = tok.decode(ids[:k + 1])
        hold = max((n for n in range(1, len(stop)) if decoded.endswith(stop[:n])), default=0)
        assert released == decoded[:len(decoded) - hold]
    assert released + outputs[-1].text == text


def test_stop_that_never_completes_is_flushed_at_finish(detok, tok):
    ids, outputs, stopped = run(detok, tok, "wait for STO", ["STOP"], per_batch=1)
    streamed = [o.text for o in outputs]
    assert "".join(streamed[:-1]) == "wait for "  # "STO" held while it could still match
    assert outputs[-1].text.endswith("STO") and outputs[-1].finish_reason == "length"
    assert "".join(streamed) == "wait for STO"
    assert [t for o in outputs for t in o.token_ids] == ids
    assert stopped == []


def test_usage_counts_hidden_and_cut_tokens(detok, tok):
    ids, outputs, _ = run(detok, tok, "one two STOP three four", ["STOP"], per_batch=0)
    assert outputs[-1].usage.completion_tokens == len(ids)  # cut tokens were generated
    ids, outputs, _ = run(detok, tok, "one two", [], per_batch=1, finish="stop", hidden=1,
                          rid="eos")
    usage = outputs[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (3, len(ids) + 1)
    assert all(o.usage is None for o in outputs[:-1])


def test_deltas_after_a_stop_are_ignored_and_state_is_freed(detok, tok):
    ids, outputs, stopped = run(detok, tok, "go STOP", ["STOP"], per_batch=0, finish=None)
    assert stopped == ["req"] and detok.num_active() == 0
    late = TokenBatch(deltas=[TokenDelta("req", ids[:2]), TokenDelta("req", [], finish_reason="abort"),
                              TokenDelta("nobody", ids)])
    assert detok.process(late) == ([], [])


@pytest.mark.parametrize("reason", ["abort", "error", "length", "stop"])
def test_every_finish_frees_state_and_flushes(detok, tok, reason):
    spec = SamplingSpec(stop=["STOP"])
    ids = tok.encode("halt ST").ids
    outs, _ = detok.process(TokenBatch(new_requests=[DetokRequest("a", 2, spec)],
                                       deltas=[TokenDelta("a", ids)]))
    assert outs[0].text == "halt " and detok.num_active() == 1
    outs, stopped = detok.process(TokenBatch(deltas=[TokenDelta("a", [], finish_reason=reason,
                                                                error=ErrorDetail("internal", "boom") if reason == "error" else None)]))
    assert (outs[0].text, outs[0].finished, outs[0].finish_reason) == ("ST", True, reason)
    assert stopped == [] and detok.num_active() == 0


def test_stop_matched_while_the_scheduler_also_finished(detok, tok):
    """The scheduler already ended the request: no Abort is asked for, reason is 'stop'."""
    ids, outputs, stopped = run(detok, tok, "a STOP b", ["STOP"], per_batch=0, finish="length")
    assert outputs[-1].finish_reason == "stop" and outputs[-1].text == "a "
    assert stopped == [] and detok.num_active() == 0


def test_token_ids_are_held_with_their_text(detok, tok):
    """A token inside a possible stop string is not sent until the text is decided."""
    text = "the stop word STOP"
    ids, outputs, _ = run(detok, tok, text, ["word STOP"], per_batch=1, logprobs=0)
    assert "".join(o.text for o in outputs) == "the stop "
    assert [len(o.token_ids) for o in outputs] == [1, 1, 0, 1]  # " word" waited for " STOP"
    sent = [t for o in outputs for t in o.token_ids]
    assert tok.decode(sent) == "the stop word"  # " word" is kept: its space is in the answer
    entries = [e for o in outputs for e in o.logprobs]
    assert (entries[-1].token, entries[-1].bytes) == (" ", [32])  # trimmed to the answer
    assert b"".join(bytes(e.bytes) for e in entries) == b"the stop "


def test_requests_in_one_batch_are_independent(detok, tok):
    a, b = tok.encode("alpha STOP x").ids, tok.encode("beta stop").ids
    batch = TokenBatch(new_requests=[DetokRequest("a", 1, SamplingSpec(stop=["STOP"])),
                                     DetokRequest("b", 1, SamplingSpec(stop=["x"]))],
                       deltas=[TokenDelta("a", a), TokenDelta("b", b)])
    outs, stopped = detok.process(batch)
    assert [(o.request_id, o.text, o.finished) for o in outs] == [
        ("a", "alpha ", True), ("b", "beta stop", False)]
    assert stopped == ["a"] and detok.num_active() == 1
    outs, stopped = detok.process(TokenBatch(deltas=[TokenDelta("b", [], finish_reason="abort")]))
    assert outs[0].finished and detok.num_active() == 0

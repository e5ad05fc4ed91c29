"""The detokenizer's output split: reasoning block, content, tool calls, echo (hand-made batches).

The block is decided on token ids, so these tests feed ids directly: a random
model cannot be made to write tags on cue, a TokenBatch can.
"""

from __future__ import annotations

import pytest

from pocketllm.detokenizer.detokenizer import Detokenizer
from pocketllm.proto.messages import (DetokRequest, OutputSplit, SamplingSpec, TokenBatch,
                                      TokenDelta, TokenLogprobs)
from test_detok_incremental import byte_level_bpe


@pytest.fixture(scope="module")
def tok():
    t = byte_level_bpe()  # has "<think>" as an added, non-special token (as Qwen3 does)
    t.add_tokens(["</think>"])
    return t


def tags(tok) -> tuple[int, int]:
    return tok.token_to_id("<think>"), tok.token_to_id("</think>")


def split_for(tok, in_reasoning=False, drop=False, tool_parser=None) -> OutputSplit:
    start, end = tags(tok)
    return OutputSplit(reasoning_start_id=start, reasoning_end_id=end, in_reasoning=in_reasoning,
                       drop_reasoning=drop, tool_parser=tool_parser)


def lp(t: int) -> TokenLogprobs:
    return TokenLogprobs(logprob=-0.5, top_token_ids=[t], top_logprobs=[-0.5])


def run(tok, ids, split, stop=(), per_batch=1, logprobs=None, finish="length", echo=""):
    """Feed ``ids`` ``per_batch`` at a time (0 = one delta); returns the outputs."""
    detok = Detokenizer(tok)
    spec = SamplingSpec(stop=list(stop), logprobs=logprobs)
    size = per_batch or len(ids)
    parts = [ids[i:i + size] for i in range(0, len(ids), size)]
    outs = []
    for i, part in enumerate(parts):
        new = [DetokRequest("r", 3, spec, split, echo)] if i == 0 else []
        delta = TokenDelta("r", part, [lp(t) for t in part] if logprobs is not None else [],
                           finish_reason=finish if i == len(parts) - 1 else None)
        got, _ = detok.process(TokenBatch(new_requests=new, deltas=[delta]))
        outs += got
        if got and got[-1].finished:
            break
    assert outs[-1].finished and detok.num_active() == 0
    return outs


def joined(outs):
    return ("".join(o.text for o in outs), "".join(o.reasoning_text for o in outs),
            outs[-1].finish_reason)


def enc(tok, text):
    return tok.encode(text).ids


@pytest.mark.parametrize("per_batch", [1, 2, 0])
def test_prompt_opened_block_then_answer_and_stop_cuts_only_the_answer(tok, per_batch):
    _, end = tags(tok)
    # "STOP" inside the reasoning must not end anything; in the answer it does.
    ids = enc(tok, "héllo STOP wörld") + [end] + enc(tok, "the stop word STOP ends")
    outs = run(tok, ids, split_for(tok, in_reasoning=True), stop=["STOP"], per_batch=per_batch)
    assert joined(outs) == ("the stop word ", "héllo STOP wörld", "stop")


@pytest.mark.parametrize("per_batch", [1, 0])
def test_generated_start_tag_opens_the_block(tok, per_batch):
    start, end = tags(tok)
    ids = enc(tok, "\n") + [start] + enc(tok, "naïve café") + [end] + enc(tok, "hello world")
    outs = run(tok, ids, split_for(tok), per_batch=per_batch)
    assert joined(outs) == ("\nhello world", "naïve café", "length")
    # every generated token is reported, the tags included
    assert [t for o in outs for t in o.token_ids] == ids


def test_start_tag_after_answer_text_is_answer_and_no_split_without_split(tok):
    start, end = tags(tok)
    ids = enc(tok, "hello") + [start] + enc(tok, "world") + [end]
    assert joined(run(tok, ids, split_for(tok))) == ("hello<think>world</think>", "", "length")
    ids = [start] + enc(tok, "world") + [end] + enc(tok, "hello")
    assert joined(run(tok, ids, None)) == ("<think>world</think>hello", "", "length")


def test_request_ending_inside_the_block_and_a_second_block(tok):
    start, end = tags(tok)
    outs = run(tok, enc(tok, "日本語のテキスト"), split_for(tok, in_reasoning=True),
               per_batch=1)
    assert joined(outs) == ("", "日本語のテキスト", "length")
    # the block opens once: a second <think> is answer text
    ids = [start] + enc(tok, "a") + [end] + enc(tok, "b") + [start]
    assert joined(run(tok, ids, split_for(tok))) == ("b<think>", "a", "length")


def test_drop_reasoning_sends_none_of_the_block(tok):
    _, end = tags(tok)
    ids = enc(tok, "héllo") + [end] + enc(tok, "world")
    outs = run(tok, ids, split_for(tok, in_reasoning=True, drop=True), logprobs=0)
    assert joined(outs) == ("world", "", "length")
    assert all(not o.reasoning_logprobs for o in outs)
    assert b"".join(bytes(e.bytes) for o in outs for e in o.logprobs) == b"world"


@pytest.mark.parametrize("per_batch", [1, 3, 0])
def test_logprobs_split_per_part_and_travel_with_their_text(tok, per_batch):
    start, end = tags(tok)
    ids = [start] + enc(tok, "emoji 😀🎉 party") + [end] + enc(tok, "5€ today STOP ends")
    outs = run(tok, ids, split_for(tok), stop=["STOP"], per_batch=per_batch, logprobs=1)
    content, reasoning, finish = joined(outs)
    assert (content, reasoning, finish) == ("5€ today ", "emoji 😀🎉 party", "stop")
    r_bytes, c_bytes, r_text, c_text = b"", b"", "", ""
    for o in outs:  # cumulative: entries never run ahead of the text they belong to
        r_text += o.reasoning_text
        c_text += o.text
        r_bytes += b"".join(bytes(e.bytes) for e in o.reasoning_logprobs)
        c_bytes += b"".join(bytes(e.bytes) for e in o.logprobs)
        assert r_text.encode().startswith(r_bytes) and c_text.encode().startswith(c_bytes)
    assert r_bytes == reasoning.encode() and c_bytes == content.encode()
    # tags have no entry; every other shown token has one
    n_entries = sum(len(o.logprobs) + len(o.reasoning_logprobs) for o in outs)
    assert n_entries == len([t for o in outs for t in o.token_ids]) - 2


@pytest.mark.parametrize("per_batch", [1, 0])
def test_tool_calls_after_the_block(tok, per_batch):
    _, end = tags(tok)
    call = '<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = enc(tok, "hello") + [end] + enc(tok, "world ") + enc(tok, call)
    outs = run(tok, ids, split_for(tok, in_reasoning=True, tool_parser="hermes"),
               per_batch=per_batch, finish="stop")
    assert joined(outs) == ("world", "hello", "tool_calls")
    calls = [c for o in outs for c in o.tool_calls]
    assert [(c.name, c.arguments) for c in calls] == [("get", '{"city":"Paris"}')]
    assert calls[0].id.startswith("call_")
    # a malformed call stays content, exactly as generated; finish_reason is the engine's
    outs = run(tok, enc(tok, "x " + call[:-3]), split_for(tok, tool_parser="hermes"),
               per_batch=per_batch)
    assert joined(outs) == ("x " + call[:-3], "", "length")
    assert not [c for o in outs for c in o.tool_calls]


def test_echo_text_leads_the_first_output_only(tok):
    outs = run(tok, enc(tok, "hello world"), None, per_batch=1, echo="Say: ")
    assert outs[0].text.startswith("Say: ") and joined(outs)[0] == "Say: hello world"

"""Tool-call tags that a GGUF vocabulary marks as control (special) tokens.

llama.cpp's converters write a tokenizer's special added tokens as CONTROL (type 3);
PocketLLM's GGUF vocabulary makes those special, so skip_special_tokens drops them.
For a request whose answer goes through a tool parser, the detokenizer still shows
the syntax's tags as text, or the parser would never see a call open.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from pocketllm.detokenizer.detokenizer import Detokenizer
from pocketllm.proto.messages import (DetokRequest, OutputSplit, SamplingSpec, TokenBatch,
                                      TokenDelta, TokenLogprobs)
from pocketllm.tokenizer.gguf_vocab import tokenizer_from_gguf
from test_gguf_vocab import _trained, _write_vocab_gguf

TAGS = ["<tool_call>", "</tool_call>"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tok(request, tmp_path_factory):
    """A byte-level (Qwen-style) or SentencePiece GGUF vocabulary with CONTROL tool tags."""
    path = str(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf")
    if request.param == "gpt2":
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trained, merges = _trained(bpe, trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<eos>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tokens = trained + TAGS
        _write_vocab_gguf(path, tokens, [3 if t in TAGS or t == "<eos>" else 1 for t in tokens],
                          model="gpt2", pre="qwen2", merges=[f"{a} {b}" for a, b in merges],
                          eos=0)
    else:
        spm = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        spm.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        trained, _ = _trained(spm, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                       special_tokens=["<unk>", "<s>", "</s>"]))
        byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
        rest = [t for t in trained if t not in ("<unk>", "<s>", "</s>")]
        tokens = ["<unk>", "<s>", "</s>"] + byte_tokens + TAGS + rest
        types = [2, 3, 3] + [6] * 256 + [3, 3] + [1] * len(rest)
        scores = [0.0] * 261 + [-float(i) for i in range(len(rest))]
        _write_vocab_gguf(path, tokens, types, model="llama", scores=scores, bos=1, eos=2)
    return tokenizer_from_gguf(path)


def run(tok, split, skip=True):
    """The call's ids, one per delta, with log probabilities; returns the outputs."""
    ids = tok.encode(CALL, add_special_tokens=False).ids
    detok = Detokenizer(tok)
    spec = SamplingSpec(logprobs=0, skip_special_tokens=skip)
    outs = []
    for i, t in enumerate(ids):
        new = [DetokRequest("r", 3, spec, split)] if i == 0 else []
        delta = TokenDelta("r", [t], [TokenLogprobs(logprob=-0.5)],
                           finish_reason="stop" if i == len(ids) - 1 else None)
        outs += detok.process(TokenBatch(new_requests=new, deltas=[delta]))[0]
    assert outs[-1].finished
    return ids, outs


def test_control_tags_are_special_and_skipped_without_a_parser(tok):
    ids, outs = run(tok, None)
    open_id, close_id = (tok.token_to_id(t) for t in TAGS)
    assert ids[0] == open_id and ids[-1] == close_id  # matched whole
    text = "".join(o.text for o in outs)
    assert "<tool_call>" not in text and text == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("skip", [True, False])
def test_a_tool_parser_sees_special_tags(tok, skip):
    split = OutputSplit(tool_parser="hermes", tools=[WEATHER])
    ids, outs = run(tok, split, skip)
    assert "".join(o.text for o in outs) == ""
    assert outs[-1].finish_reason == "tool_calls"
    [call] = outs[-1].tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Paris"}')
    # the answer's entries cover the call text, tags included, byte for byte
    entries = [e for o in outs for e in o.logprobs]
    assert [e.token_id for e in entries] == ids
    assert bytes(b for e in entries for b in e.bytes) == CALL.encode()
    assert entries[0].token == "<tool_call>"

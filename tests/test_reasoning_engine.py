"""A thinking-model template end to end: a tiny random checkpoint whose (Qwen3-like) chat
template opens ``<think>`` in the generation prompt, through LLM and the real server.

The prompt ends inside the block, so a random model's output is reasoning until it
happens to write ``</think>`` (id 9); the assertions are derived from the token ids,
never from what a random model "should" say. The detokenizer's split rules on
hand-made batches are in test_detok_reasoning.py.
"""

from __future__ import annotations

import json

import httpx
import pytest

from pocketllm import LLM, EngineArgs, SamplingParams
from server_process import ServerProcess
from tiny_checkpoints import END_THINK_ID, THINK_ID, make_tiny_checkpoint

THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
MSG = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def thinking_ckpt(tmp_path_factory) -> str:
    path = make_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("tiny-thinking")))
    cfg_path = f"{path}/tokenizer_config.json"
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = THINKING_TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return path


@pytest.fixture(scope="module")
def tok(thinking_ckpt):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{thinking_ckpt}/tokenizer.json")


@pytest.fixture(scope="module")
def llm(thinking_ckpt):
    engine = LLM(EngineArgs(model=thinking_ckpt, max_num_batched_tokens=128, seed=0))
    yield engine
    engine.shutdown()


def greedy(n=24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def utf8(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def split_ids(ids: list[int]) -> tuple[list[int], list[int]]:
    """(reasoning ids, answer ids) of a completion whose prompt opened the block."""
    if END_THINK_ID in ids:
        k = ids.index(END_THINK_ID)
        return ids[:k], ids[k + 1:]
    return ids, []


def test_split_stream_and_whole_agree_and_stop_spares_the_reasoning(llm, tok):
    out = llm.chat(MSG, greedy(logprobs=0))[0]
    reasoning_ids, answer_ids = split_ids(out.token_ids)
    assert out.reasoning_text == tok.decode(reasoning_ids, skip_special_tokens=True)
    assert out.text == tok.decode(answer_ids, skip_special_tokens=True)
    assert len(out.reasoning_text) >= 4, "the random model should say something"
    # (a random model writes invalid UTF-8 too: the text has U+FFFD where the bytes do not)
    assert utf8(b"".join(bytes(e.bytes) for e in out.reasoning_logprobs)) == out.reasoning_text
    assert utf8(b"".join(bytes(e.bytes) for e in out.logprobs)) == out.text

    events = list(llm.chat_stream(MSG, greedy()))
    assert "".join(e.reasoning_text for e in events) == out.reasoning_text
    assert "".join(e.text for e in events) == out.text

    # A stop string that occurs in the reasoning does not cut it (same greedy tokens).
    stop = out.reasoning_text[1:4]
    cut = llm.chat(MSG, greedy(stop=[stop]))[0]
    assert cut.reasoning_text == out.reasoning_text
    at = out.text.find(stop)
    assert cut.text == (out.text if at < 0 else out.text[:at])
    assert cut.finish_reason == ("length" if at < 0 else "stop")


def test_drop_thinking_and_thinking_mode_off(llm, tok):
    whole = llm.chat(MSG, greedy())[0]
    dropped = llm.chat(MSG, greedy(), drop_thinking=True)[0]
    assert dropped.reasoning_text == "" and dropped.text == whole.text
    assert dropped.token_ids == whole.token_ids  # the model still thought
    # thinking_mode=False: the template closes the block in the prompt; a later <think> is
    # answer unless it is the first (blank) output
    off = llm.chat(MSG, greedy(), thinking_mode=False)[0]
    if THINK_ID not in off.token_ids[:1]:
        assert off.reasoning_text == ""
        assert off.text == tok.decode(off.token_ids, skip_special_tokens=True)


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(thinking_ckpt):
    srv = ServerProcess("--model", thinking_ckpt, "--served-model-name", "tiny",
                        "--max-num-batched-tokens", "256", "--max-model-len", "512")
    yield srv
    assert srv.stop() == 0


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def sse(server, path, body) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}


def test_chat_reasoning_content_whole_and_streamed_with_logprobs(server):
    body = {"messages": MSG, **GREEDY, "logprobs": True, "top_logprobs": 2}
    whole = post(server, "/v1/chat/completions", body).json()["choices"][0]
    msg, lp = whole["message"], whole["logprobs"]
    assert msg["reasoning_content"]
    assert utf8(bytes(b for e in lp["reasoning_content"] for b in e["bytes"])) == \
        msg["reasoning_content"]
    assert utf8(bytes(b for e in lp["content"] for b in e["bytes"])) == msg["content"]

    chunks = sse(server, "/v1/chat/completions", body)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == \
        msg["reasoning_content"]
    assert "".join(d["delta"].get("content", "") for d in deltas) == msg["content"]
    streamed = [e for d in deltas if d["logprobs"] for e in d["logprobs"]["content"]]
    streamed_r = [e for d in deltas if d["logprobs"]
                  for e in d["logprobs"].get("reasoning_content", [])]
    assert streamed == lp["content"] and streamed_r == lp["reasoning_content"]
    # (per-chunk alignment is checked on valid UTF-8 in test_detok_reasoning.py; a random
    # model's invalid bytes shift it by a token, as the detokenizer documents)

    dropped = post(server, "/v1/chat/completions", {**body, "drop_thinking": True}).json()
    assert "reasoning_content" not in dropped["choices"][0]["message"]
    assert dropped["choices"][0]["message"]["content"] == msg["content"]


def test_completions_streamed_logprobs_concatenate_to_the_whole(server, tok):
    # Non-ASCII byte tokens banned: the random model then writes valid UTF-8, where the
    # entries' bytes reassemble the text exactly, a stop string's cut included.
    ban = {str(i): -100 for i in range(tok.get_vocab_size())
           if "\ufffd" in tok.decode([i], skip_special_tokens=False)}
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0.8, "seed": 3,
            "logprobs": 2, "stop": ["e"], "logit_bias": ban}
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    chunks = sse(server, "/v1/completions", body)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]
           and c["choices"][0]["logprobs"]]
    assert "".join(texts) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset", "content"):
        assert [x for lp in lps for x in lp[key]] == whole["logprobs"][key], key
    assert bytes(b for e in whole["logprobs"]["content"] for b in e["bytes"]).decode() == \
        whole["text"] and whole["finish_reason"] == "stop"


def test_echo(server, tok):
    r = post(server, "/v1/completions", {"prompt": "Hello world", "max_tokens": 4,
                                         "echo": True, "temperature": 0})
    plain = post(server, "/v1/completions", {"prompt": "Hello world", "max_tokens": 4,
                                             "temperature": 0}).json()["choices"][0]["text"]
    assert r.json()["choices"][0]["text"] == "Hello world" + plain
    chunks = sse(server, "/v1/completions", {"prompt": "Hello world", "max_tokens": 4,
                                             "echo": True, "temperature": 0})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        "Hello world" + plain
    ids = post(server, "/v1/completions", {"prompt": [5, 40, 41], "max_tokens": 2,
                                           "echo": True}).json()["choices"][0]["text"]
    # token ids shown as the tokenizer decodes them (special tokens skipped by default)
    assert ids.startswith(tok.decode([5, 40, 41])) and len(tok.decode([5, 40, 41])) > 1
    r = post(server, "/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_best_of_returns_the_candidates_of_highest_cumulative_logprob(server):
    base = {"prompt": "Paris is", "max_tokens": 6, "temperature": 1.0, "seed": 11}
    every = post(server, "/v1/completions", {**base, "n": 4, "logprobs": 0}).json()
    scored = sorted(((sum(c["logprobs"]["token_logprobs"]), c["text"])
                     for c in every["choices"]), reverse=True)
    best = post(server, "/v1/completions", {**base, "n": 2, "best_of": 4}).json()
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert [c["text"] for c in best["choices"]] == [t for _, t in scored[:2]]
    assert all(c["logprobs"] is None for c in best["choices"])  # not asked for
    assert best["usage"]["completion_tokens"] == every["usage"]["completion_tokens"]
    for bad in ({"n": 3, "best_of": 2}, {"best_of": 2, "stream": True}):
        r = post(server, "/v1/completions", {**base, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text

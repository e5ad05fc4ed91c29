"""Requests known to have broken the server (issue 18's list, and what the fuzzer found).

The fuzz tests try each of these first, as explicit examples, before generating others,
so a regression of a known failure is caught by name on every run.
"""

from __future__ import annotations

from fuzz_strategies import Deep, Rep

HI = [{"role": "user", "content": "Hi"}]
BIG = 2**64

# (endpoint, body, headers)
KNOWN: list[tuple[str, dict, dict]] = [
    # killed the tokenizer: template kwargs that override the template's own variables
    ("chat", {"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"bos_token": "x"}}, {}),
    ("chat", {"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"messages": []}}, {}),
    ("chat", {"messages": HI, "max_tokens": 2,
              "chat_template_kwargs": {"add_generation_prompt": "x"}}, {}),
    # killed the scheduler: json_object with stop_token_ids outside the vocabulary / 64 bits
    ("chat", {"messages": HI, "max_tokens": 2, "response_format": {"type": "json_object"},
              "stop_token_ids": [300000]}, {}),
    ("chat", {"messages": HI, "max_tokens": 2, "response_format": {"type": "json_object"},
              "stop_token_ids": [BIG]}, {}),
    ("completion", {"prompt": "Hi", "max_tokens": 2, "stop_token_ids": [300000]}, {}),
    # killed the detokenizer: one stop string of 1 MB
    ("completion", {"prompt": "Hi", "max_tokens": 2, "stop": Rep("x", 1 << 20)}, {}),
    # bare 500s: integers beyond 64 bits
    ("completion", {"prompt": "Hi", "max_tokens": BIG}, {}),
    ("completion", {"prompt": "Hi", "max_tokens": 2, "top_k": BIG}, {}),
    ("completion", {"prompt": "Hi", "max_tokens": 2, "seed": BIG, "request_id": "fz-seed"}, {}),
    ("completion", {"prompt": "Hi", "max_tokens": 2, "stop_token_ids": [BIG]}, {}),
    ("completion", {"prompt": "Hi", "max_tokens": 2, "logit_bias": {str(BIG): 1}}, {}),
    ("completion", {"prompt": [BIG], "max_tokens": 2}, {}),
    ("completion", {"prompt": [300000], "max_tokens": 2}, {}),
    # lone surrogates in content and stop strings
    ("chat", {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}, {}),
    ("completion", {"prompt": "a\udfffb", "max_tokens": 2}, {}),
    ("completion", {"prompt": "Hi", "max_tokens": 2, "stop": "\ud800"}, {}),
    # JSON nested 10,000 levels
    ("completion", {"prompt": "Hi", "max_tokens": 2, "metadata": Deep(10_000, "[")}, {}),
    ("chat", {"messages": HI, "max_tokens": 2, "user": Deep(10_000, "{")}, {}),
    # grammars that match nothing / only the empty string
    ("completion", {"prompt": "Hi", "max_tokens": 2,
                    "response_format": {"type": "regex", "regex": "[^\\s\\S]"}}, {}),
    ("completion", {"prompt": "Hi", "max_tokens": 2,
                    "response_format": {"type": "grammar", "grammar": "root ::= root"}}, {}),
    ("completion", {"prompt": "Hi", "max_tokens": 2,
                    "response_format": {"type": "grammar", "grammar": 'root ::= ""'}}, {}),
    # an error body that is not OpenAI-shaped: a 10,000-character X-Request-Id
    ("completion", {"prompt": "Hi", "max_tokens": 2}, {"X-Request-Id": "a" * 10_000}),
    # aiohttp's own errors: an unknown Expect, a body that is not what Content-Encoding says
    ("completion", {"prompt": "Hi", "max_tokens": 2}, {"Expect": "nope"}),
    ("completion", {"prompt": "Hi", "max_tokens": 2}, {"Content-Encoding": "gzip"}),
    ("completion", {"prompt": "Hi", "max_tokens": 2}, {"Content-Encoding": "x-nope"}),
]

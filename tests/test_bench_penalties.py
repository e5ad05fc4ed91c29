"""`pocketllm bench throughput`'s penalty flags become valid SamplingParams fields."""

from __future__ import annotations

from pocketllm.bench.throughput import Penalties
from pocketllm.cli import build_parser
from pocketllm.sampling import SamplingParams


def test_unused_by_default_and_valid_when_set():
    parser = build_parser()
    ns = parser.parse_args(["bench", "throughput"])
    unused = Penalties(ns.frequency_penalty, ns.presence_penalty, ns.repetition_penalty,
                       ns.logit_bias_tokens)
    assert unused.fields(1000, 0) == {}
    ns = parser.parse_args(["bench", "throughput", "--frequency-penalty", "0.5",
                            "--presence-penalty", "0.5", "--repetition-penalty", "1.2",
                            "--logit-bias-tokens", "100"])
    fields = Penalties(ns.frequency_penalty, ns.presence_penalty, ns.repetition_penalty,
                       ns.logit_bias_tokens).fields(1000, 0)
    assert len(fields.pop("logit_bias")) == 100
    assert fields == {"frequency_penalty": 0.5, "presence_penalty": 0.5,
                      "repetition_penalty": 1.2}
    SamplingParams(**Penalties(0.5, 0.5, 1.2, 100).fields(1000, 0))  # validates

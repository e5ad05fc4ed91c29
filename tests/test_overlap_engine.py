"""Overlapped scheduling through the whole process graph (forced on, on the CPU): the
same tokens as the synchronous engine, streamed the same way, with penalty requests in
the batch falling back to synchronous steps."""

from __future__ import annotations

import random

import pytest

from pocketllm import LLM, EngineArgs, SamplingParams


@pytest.fixture(scope="module")
def llm_overlap(tiny_llama):
    llm = LLM(EngineArgs(model=tiny_llama, max_num_batched_tokens=64, seed=0,
                         overlap_scheduling=True))
    yield llm
    llm.shutdown()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(12, 512) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def test_overlap_matches_the_synchronous_engine(llm_overlap, llm_tiny):
    batch = prompts(12, 1)
    params = [SamplingParams(max_tokens=1 + i * 3, temperature=0.0 if i % 2 else 0.8, seed=i)
              for i in range(len(batch))]
    before = llm_overlap._client.stats.overlapped_steps
    ours = llm_overlap.generate(batch, params)
    assert llm_overlap._client.stats.overlapped_steps > before + 10, "overlap never engaged"
    ref = llm_tiny.generate(batch, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in ours] == [o.finish_reason for o in ref]


def test_overlap_streams_and_falls_back_for_penalties(llm_overlap, llm_tiny):
    batch = prompts(4, 2)
    params = [SamplingParams(max_tokens=20, temperature=0.0),
              SamplingParams(max_tokens=20, temperature=0.0, presence_penalty=1.5),
              SamplingParams(max_tokens=20, temperature=0.0, logit_bias={40: 100.0}),
              SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[7])]
    ours = llm_overlap.generate(batch, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in llm_tiny.generate(batch, params)]
    assert set(ours[2].token_ids) == {40}
    streamed = [e.token_ids for e in llm_overlap.generate_stream(batch[0], params[0])]
    assert sum(streamed, []) == ours[0].token_ids

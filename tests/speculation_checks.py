"""Checks shared by the speculative decoding tests (test_speculative.py,
test_speculative_torch.py, test_draft_model.py, test_mtp.py): an engine's text with
speculation against the text without it, and the drafts it verified and accepted."""

from __future__ import annotations

import pytest


def same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]


def draft_counts(llm, before):
    from pocketllm.bench.throughput import settled_stats

    after = settled_stats(llm, newer_than=before, timeout=5.0)
    return (after.spec_draft_tokens - before.spec_draft_tokens,
            after.spec_accepted_tokens - before.spec_accepted_tokens)


def same_and_drafts(llm, want, prompts, sampling, times: int = 1) -> tuple[int, int]:
    """Generate ``times`` over, each time the outputs ``want``; then shut ``llm`` down:
    (drafts verified, accepted) meanwhile."""
    try:
        before = llm.engine_stats()
        for _ in range(times):
            same(want, llm.generate(prompts, sampling))
        return draft_counts(llm, before)
    finally:
        llm.shutdown()


def same_case_by_case(make_engine, cases, prompts, **common) -> None:
    """Each of ``cases`` (SamplingParams) gives the text without speculation on an engine
    of ``make_engine(**kw)``, with drafts verified (a seeded case runs ``prompts[0]``
    three times at once, the server's n = 3); then so does greedy decoding in a KV cache
    small enough to preempt. ``common``: the engine without speculation."""
    from pocketllm import SamplingParams

    llm = make_engine()
    try:
        for sp in cases:
            run = [prompts[0]] * 3 if sp.seed is not None else prompts
            before = llm.engine_stats()
            same(decoded(run, sp, **common), llm.generate(run, sp))
            assert draft_counts(llm, before)[0] > 0, sp
    finally:
        llm.shutdown()
    many = [[60 + i, 61 + i, 62, 60 + i, 61 + i] for i in range(6)]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = decoded(many, greedy, **common, num_kv_blocks=12)
    llm = make_engine(num_kv_blocks=12)
    try:
        same(want, llm.generate(many, greedy))
        assert llm.engine_stats().preemptions > 0
    finally:
        llm.shutdown()


def decoded(prompts, sampling, **engine):
    """The output of an engine without speculation."""
    from pocketllm import LLM

    llm = LLM(**engine)
    try:
        return llm.generate(prompts, sampling)
    finally:
        llm.shutdown()


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


GPU = pytest.mark.skipif(not cuda_available(), reason="needs CUDA")

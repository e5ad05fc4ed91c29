"""Speculative decoding with a draft model (``speculative_method="draft"``,
workers/draft_model.py): the worker runs a smaller model of the same vocabulary beside the
target, which proposes each request's next drafts; the target verifies them. Tiny random
checkpoints (tests/tiny_checkpoints.py, one tokenizer for all), the torch worker on the CPU
(and on a GPU where there is one)."""

from __future__ import annotations

import pytest

from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError
from pocketllm.scheduler.worker_drafts import WorkerDrafter
from test_scheduler_harness import Driver, config, make_request
from speculation_checks import (GPU, decoded, draft_counts, same, same_and_drafts,
                                same_case_by_case)


def _tiny(family="llama", **overrides):
    from tiny_checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(family, overrides=overrides or None)


PROMPTS = [[40, 41, 42, 43, 40, 41, 42, 43, 40, 41], [50, 51, 52, 50, 51, 52, 50]]


def _draft_engine(target, draft, device="cpu", **kw):
    from pocketllm import LLM

    return LLM(model=target, dtype="float32", max_model_len=256, device=device,
               speculative_method="draft", speculative_model=draft, **kw)


# --- the scheduler: asking the worker for drafts ----------------------------------------------

class Proposer:
    """A fake worker's draft model: it proposes what the fake worker will sample (its
    ``next_token``), the first ``right`` of each proposal, then wrong ones."""

    def __init__(self, right: int):
        self.right = right

    def __call__(self, tokens: list[int], count: int) -> list[int]:
        from test_scheduler_harness import next_token

        out = []
        for j in range(count):
            t = next_token(tokens + out)
            out.append(t if j < self.right else t + 1)
        return out


def _run_with_proposals(reqs, right, **cfg):
    driver = Driver(config(num_speculative_tokens=4, speculative_method="draft", **cfg))
    for r in reqs:
        driver.add(r)
    proposer = Proposer(right)
    sched = driver.sched

    def proposals(plan, result):
        """What the worker returns for the plan's asks (the harness computes the rest)."""
        ids = [r.request_id for r in plan.new_requests] + [r.request_id
                                                           for r in plan.cached_requests]
        asks = dict(zip(ids, plan.propose_token_counts))
        out = []
        for i, rid in enumerate(result.request_ids):
            req = sched._requests.get(rid)
            extra = result.extra_token_ids[i] if result.extra_token_ids else []
            tokens = ([t for t in req.token_ids if t >= 0] if req else []) + [
                result.token_ids[i], *extra]
            out.append(proposer(tokens, asks.get(rid, 0)) if asks.get(rid) else [])
        result.proposed_token_ids = out if any(out) else []

    driver.before_update = proposals
    return driver.run(), driver


@pytest.mark.parametrize("right", [4, 1, 0])
def test_the_scheduler_verifies_what_the_worker_proposed(right):
    from test_speculative import requests, run

    want, plain = run(requests())
    got, driver = _run_with_proposals(requests(), right)
    assert {k: (o.tokens, o.finish_reason) for k, o in got.items()} == \
        {k: (o.tokens, o.finish_reason) for k, o in want.items()}
    asked = [p for p in driver.plans if p.propose_token_counts]
    drafted = [p for p in driver.plans if p.draft_token_ids]
    assert asked and drafted
    stats = driver.sched.stats()
    if right == 4:
        assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0
        assert len(driver.plans) < len(plain.plans) / 2
    elif right == 0:
        assert stats["spec_accepted_tokens"] == 0
        # asked for what the next step carries: after the first failures, probes of one
        asks = {}
        for plan in asked:
            ids = [r.request_id for r in (*plan.new_requests, *plan.cached_requests)]
            for rid, n in zip(ids, plan.propose_token_counts):
                asks.setdefault(rid, []).append(n)
        assert all(n[:2] == [4, 4] and set(n[2:]) == {1} for n in asks.values()), asks
    for plan in driver.plans:  # never asked while a step is in flight, nor beyond k
        assert all(0 <= n <= 4 for n in plan.propose_token_counts)


def test_proposals_are_asked_only_below_the_batch_limit_and_get_their_blocks():
    many = [make_request(f"r{i}", [i, i + 1, i + 2], max_tokens=6) for i in range(6)]
    _, driver = _run_with_proposals(many, 4, speculative_max_batch=4)
    for plan in driver.plans:
        if plan.propose_token_counts:
            running = len(plan.new_requests) + len(plan.cached_requests)
            assert running <= 4
    driver.sched.check_invariants()


def test_an_offer_that_no_longer_follows_the_tokens_is_dropped():
    d = WorkerDrafter(4)
    d.offer("a", 5, [1, 2, 3])
    assert d.propose("a", [0] * 6, 4) == []  # the tokens moved on: stale
    d.offer("a", 6, [1, 2, 3])
    assert d.propose("a", [0] * 6, 2) == [1, 2]
    assert d.propose("a", [0] * 6, 2) == []  # used once


# --- the engine --------------------------------------------------------------------------------

@pytest.mark.parametrize("family,device", [
    ("llama", "cpu"), ("deepseek_v2", "cpu"), ("qwen3_5", "cpu"),
    pytest.param("llama", "cuda", marks=GPU), pytest.param("qwen3_5", "cuda", marks=GPU)])
def test_greedy_text_is_the_same_with_a_draft_model(family, device):
    """A dense, an MLA and a hybrid target, each drafted for by itself-shaped llama drafts:
    the target as its own draft (llama: every draft accepted), a one-layer model (few
    accepted) and the target with another norm epsilon (most accepted, some not): the
    text is the text without speculation, twice (the second from the prefix cache)."""
    from pocketllm import SamplingParams

    target = _tiny(family)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = decoded(PROMPTS, greedy, model=target, dtype="float32", max_model_len=256,
                    device=device)
    drafts = [_tiny("llama", num_hidden_layers=1), _tiny("llama", rms_norm_eps=1e-2)]
    if family == "llama":
        drafts.insert(0, target)
    for i, draft in enumerate(drafts):
        drafted, accepted = same_and_drafts(_draft_engine(target, draft, device), want,
                                             PROMPTS, greedy, times=2)
        assert drafted > 0
        if family == "llama" and i == 0:
            assert accepted == drafted


def test_the_bench_replays_inside_the_draft_models_proposals():
    """``bench latency --speculative-method draft --speculative-replay none``: the draft
    model's own settings drop the replay with the rest of the speculative ones
    (``EngineArgs.without_speculation``), it proposes, and its proposals carry the moved
    recording, none of which is accepted."""
    import re

    from pocketllm.bench.latency import speculative_replay
    from pocketllm.config import EngineArgs
    from tiny_checkpoints import VOCAB_SIZE

    args = EngineArgs(model=_tiny(), dtype="float32", device="cpu", max_model_len=256,
                      speculative_method="draft",
                      speculative_model=_tiny("llama", num_hidden_layers=1))
    report = speculative_replay(args, None, 12, 16, 1, 0, "none", VOCAB_SIZE, 1)
    assert "inside the draft drafter's proposals" in report
    verified, accepted = map(int, re.search(r"(\d+) verified, (\d+) accepted", report).groups())
    assert verified > 0 and accepted == 0, report


def test_sampled_text_is_the_same_seed_by_seed_and_coupled_drafts_are_accepted():
    """Seeded sampling: the same tokens with the draft model as without, seed by seed;
    the target as its own draft samples each draft with the target's uniform at that
    position, so (near) every draft is accepted, unseeded requests too (a seed drawn for
    them at arrival)."""
    from pocketllm import SamplingParams

    target = _tiny()
    llm = _draft_engine(target, target)
    try:
        for seed in range(4):
            sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=seed,
                                ignore_eos=True)
            want = decoded(PROMPTS, sp, model=target, dtype="float32", max_model_len=256,
                            device="cpu")
            same(want, llm.generate(PROMPTS, sp))
        before = llm.engine_stats()
        llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True))
        drafted, accepted = draft_counts(llm, before)
    finally:
        llm.shutdown()
    assert drafted > 0 and accepted >= 0.9 * drafted


def test_stops_penalties_grammars_n_and_preemption_with_a_draft_model():
    """Stop strings and max_tokens landing mid-run, penalties and logit_bias per position,
    a JSON grammar, one seeded prompt three times at once (the server's n = 3), and a KV
    cache small enough to preempt: each the text without speculation."""
    from pocketllm import SamplingParams

    target, draft = _tiny(), _tiny("llama", rms_norm_eps=1e-2)
    common = dict(model=target, dtype="float32", max_model_len=256, device="cpu")
    cases = [SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0, frequency_penalty=0.5,
                            presence_penalty=0.3, logit_bias={45: 2.0}),
             SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3),
             SamplingParams(max_tokens=20, temperature=0.8, seed=7),
             SamplingParams(max_tokens=30, temperature=0, response_format={"type": "json_object"})]
    plain = decoded(PROMPTS, SamplingParams(max_tokens=24, temperature=0), **common)
    stop = plain[0].text[len(plain[0].text) // 2:][:3]
    cases.append(SamplingParams(max_tokens=24, temperature=0, stop=[stop]))
    same_case_by_case(lambda **kw: _draft_engine(target, draft, **kw), cases, PROMPTS, **common)


def test_a_long_prompt_is_read_by_the_draft_model_in_chunks():
    """A prompt longer than the step budget: the target reads it in chunks, and so does
    the draft model when it first proposes (``DraftModel._catch_up``); then drafts, all
    accepted from the target as its own draft."""
    from pocketllm import SamplingParams

    target = _tiny()
    prompt = [[(7 * i) % 400 + 20 for i in range(45)]]
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = decoded(prompt, greedy, model=target, dtype="float32", max_model_len=256,
                    device="cpu", max_num_batched_tokens=16)
    drafted, accepted = same_and_drafts(_draft_engine(target, target, max_num_batched_tokens=16),
                                         want, prompt, greedy)
    assert drafted > 0 and accepted == drafted


# --- refusals ----------------------------------------------------------------------------------

def test_draft_model_refusals():
    from pocketllm import LLM
    from pocketllm.config import EngineArgs

    with pytest.raises(InvalidRequestError, match="speculative_model"):
        EngineArgs(speculative_method="draft")
    with pytest.raises(InvalidRequestError, match="speculative_model"):
        EngineArgs(speculative_model="x")
    target = _tiny()
    with pytest.raises(UnsupportedFeatureError, match="vocabulary has 300 ids"):
        _draft_engine(target, _tiny("llama", vocab_size=300))
    with pytest.raises(UnsupportedFeatureError, match="sliding-window layers"):
        _draft_engine(target, _tiny("gemma3")).shutdown()
    assert LLM  # (the engine is the one users build)

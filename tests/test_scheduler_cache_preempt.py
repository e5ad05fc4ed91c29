"""Scheduler: prefix caching, LRU eviction, preemption under memory pressure, random workloads."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pocketllm.scheduler.block_manager import hash_block
from test_scheduler_harness import Driver, config, make_request, run_matching_solo, solo


def chain(prompt, block_size):
    hashes, parent = [], None
    for i in range(len(prompt) // block_size):
        parent = hash_block(parent, prompt[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


def test_prefix_hit_skips_the_shared_prefix():
    d = Driver(config(block_size=8))
    a_prompt = list(range(40))
    b_prompt = list(range(35)) + list(range(900, 910))
    d.add(make_request("a", a_prompt, max_tokens=3))
    d.run()
    d.add(make_request("b", b_prompt, max_tokens=3))
    plan = d.step()
    assert plan.new_requests[0].num_computed_tokens == 32  # 4 full blocks shared
    assert plan.num_scheduled_tokens == [13]
    outs = d.run()
    assert outs["b"].cached == 32 and outs["a"].cached == 0
    assert outs["b"].tokens == solo(make_request("b", b_prompt, max_tokens=3)).tokens
    s = d.sched.stats()
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (40 + 45, 32)


def test_full_match_still_computes_the_last_block():
    d = Driver(config(block_size=8))
    prompt = list(range(32))
    d.add(make_request("a", prompt, max_tokens=2))
    d.run()
    d.add(make_request("b", prompt, max_tokens=2))
    plan = d.step()
    assert plan.new_requests[0].num_computed_tokens == 24 and plan.num_scheduled_tokens == [8]
    assert d.run()["b"].tokens == d.outcomes["a"].tokens


def test_running_requests_share_published_blocks():
    d = Driver(config(block_size=4))
    d.add(make_request("a", range(16), max_tokens=10))
    d.add(make_request("same_step", range(16), max_tokens=10))  # admitted together: no hit yet
    first = d.step()
    assert [r.num_computed_tokens for r in first.new_requests] == [0, 0]
    d.add(make_request("b", list(range(12)) + [77, 78, 79], max_tokens=10))
    second = d.step()
    (b,) = second.new_requests
    a_blocks = first.new_requests[0].block_ids
    assert b.num_computed_tokens == 12 and b.block_ids[0][:3] == a_blocks[0][:3]
    assert [d.sched.block_manager.ref_counts[x] for x in a_blocks[0][:3]] == [2, 2, 2]
    outs = d.run()
    assert outs["a"].tokens == outs["same_step"].tokens
    assert outs["b"].tokens == solo(make_request("b", list(range(12)) + [77, 78, 79],
                                                 max_tokens=10)).tokens


def test_eviction_is_lru_and_tail_first():
    d = Driver(config(block_size=4, num_kv_blocks=8))
    a, b, c = list(range(12)), list(range(100, 112)), list(range(200, 216))
    for rid, prompt in (("a", a), ("b", b)):
        d.add(make_request(rid, prompt, max_tokens=1))
        d.run()
    bm = d.sched.block_manager
    assert len(bm.match_prefix(chain(a, 4))) == 3 and len(bm.match_prefix(chain(b, 4))) == 3
    d.add(make_request("c", c, max_tokens=1))  # 4 blocks: 2 plain free + the 2 oldest cached
    d.run()
    # two of a's and b's six cached blocks were evicted (each hash looked up on its own)
    assert sum(bm.match_prefix([h]) != [] for h in chain(a, 4) + chain(b, 4)) == 4
    assert len(bm.match_prefix(chain(a, 4))) == 1  # a's tail went first, its head stays
    assert len(bm.match_prefix(chain(b, 4))) == 3
    d.add(make_request("b2", b, max_tokens=1))
    assert d.run()["b2"].cached == 8  # at most (12 - 1) // 4 blocks, one token left to compute


def test_prefix_caching_off_counts_nothing():
    d = Driver(config(enable_prefix_caching=False))
    for rid in ("a", "b"):
        d.add(make_request(rid, range(20), max_tokens=2))
        d.run()
    s = d.sched.stats()
    assert s["prefix_cache_queries"] == s["prefix_cache_hits"] == 0
    assert d.outcomes["b"].cached == 0 and d.sched.block_manager.num_cached_free_blocks == 0


def test_preemption_policy_newest_first_back_to_the_front():
    d = Driver(config(block_size=4, num_kv_blocks=6, max_num_seqs=3, max_num_batched_tokens=64))
    for i in range(4):  # r3 waits for a seat
        d.add(make_request(f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4], max_tokens=12))
    outs = d.run()
    preempting = [(k, p.finished_request_ids) for k, p in enumerate(d.plans)
                  if p.finished_request_ids and not p.new_requests]
    # Step 5: all three need a third block and none is free: r2, the newest, makes room.
    assert preempting[0] == (5, ["r2"])
    assert [c.request_id for c in d.plans[5].cached_requests] == ["r0", "r1"]
    assert preempting[1] == (9, ["r1"])
    # Preempted requests go back to the front, ahead of r3, which arrived earlier than
    # their re-admission; r1 finds its own blocks still cached.
    admissions = [(n.request_id, n.num_computed_tokens, len(n.token_ids))
                  for p in d.plans[1:] for n in p.new_requests]
    assert admissions[:3] == [("r1", 8, 13), ("r2", 0, 9), ("r3", 0, 4)]
    assert all(o.cached == 0 for o in outs.values())  # usage reports the first admission's hit
    assert d.sched.stats()["prefix_cache_hits"] > 0 and d.sched.stats()["preemptions"] == 3
    for r in ("r0", "r1", "r2", "r3"):
        assert outs[r].tokens == solo(make_request(r, [int(r[1]) * 10 + j for j in range(1, 5)],
                                                   max_tokens=12)).tokens


def long_requests(n=8, shared_prefix=8):
    rng = random.Random(0)
    shared = [rng.randrange(1000) for _ in range(shared_prefix)]
    reqs = []
    for i in range(n):
        tail = [rng.randrange(1000) for _ in range(rng.randrange(4, 13))]
        prompt = (shared if i % 2 else []) + tail
        reqs.append(make_request(f"r{i}", prompt, max_tokens=24))
    return reqs


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
def test_preemption_under_a_tiny_cache_keeps_every_answer(caching, chunked):
    reqs = long_requests()
    cfg = dict(block_size=4, num_kv_blocks=12, max_num_seqs=8, max_num_batched_tokens=24,
               enable_prefix_caching=caching, enable_chunked_prefill=chunked)
    d = Driver(config(**cfg))
    outs = run_matching_solo(d, reqs)
    assert d.sched.stats()["preemptions"] > 0
    for r in reqs:
        assert outs[r.request_id].finish_reason == "length"
    assert d.sched.stats()["kv_blocks_used"] == 0
    assert d.sched.block_manager.num_free_blocks == 12
    def preempted_in(k):  # ids plan k told ranks to drop that come back as new later
        return {rid for rid in d.plans[k].finished_request_ids
                if any(n.request_id == rid for q in d.plans[k + 1:] for n in q.new_requests)}

    assert any(preempted_in(k) for k in range(len(d.plans)))
    for k, p in enumerate(d.plans):  # a step that preempts is short of memory: it admits nobody
        assert not (preempted_in(k) and p.new_requests), k
    prompt_len = {r.request_id: len(r.prompt_token_ids) for r in reqs}
    assert any(len(n.token_ids) > prompt_len[n.request_id]
               for p in d.plans for n in p.new_requests)  # re-sent with its generated tokens


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), block_size=st.sampled_from([1, 2, 4, 8]),
       num_reqs=st.integers(1, 10), budget=st.integers(1, 40), max_seqs=st.integers(1, 8),
       caching=st.booleans(), chunked=st.booleans(), aborts=st.integers(0, 3))
def test_random_workloads_match_solo_runs(seed, block_size, num_reqs, budget, max_seqs,
                                          caching, chunked, aborts):
    rng = random.Random(seed)
    max_model_len = 48
    base = [rng.randrange(50) for _ in range(24)]
    reqs = []
    for i in range(num_reqs):
        prompt = base[:rng.randrange(0, 24)] + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        reqs.append(make_request(f"q{i}", prompt, max_tokens=rng.randrange(1, 20),
                                 eos=(rng.randrange(1000),)))
    need = max(-(-min(len(r.prompt_token_ids) + r.sampling.max_tokens, max_model_len) // block_size)
               for r in reqs)
    num_blocks = need + rng.randrange(0, need // 2 + 2)  # tight: preemption is common
    d = Driver(config(block_size=block_size, num_kv_blocks=num_blocks, max_num_seqs=max_seqs,
                      max_num_batched_tokens=budget, max_model_len=max_model_len,
                      enable_prefix_caching=caching, enable_chunked_prefill=chunked))
    pending = list(reqs)
    abort_at = {rng.randrange(1, 30): reqs[rng.randrange(num_reqs)].request_id for _ in range(aborts)}
    aborted = set()
    for step in range(5000):
        while pending and (not d.sched.has_unfinished() or rng.random() < 0.7):
            d.add(pending.pop(0))  # requests arrive while others run
        rid = abort_at.get(step)
        if rid is not None and d.sched.is_active(rid):
            d.collect(d.sched.abort([rid]))
            aborted.add(rid)
        if d.step() is None and not pending:
            break
    assert not d.sched.has_unfinished()
    assert d.sched.stats()["kv_blocks_used"] == 0
    for r in reqs:
        out = d.outcomes[r.request_id]
        if r.request_id in aborted:
            assert out.finish_reason == "abort"
            continue
        ref = solo(r, block_size=block_size, max_model_len=max_model_len)
        assert (out.tokens, out.finish_reason, out.hidden) == (ref.tokens, ref.finish_reason,
                                                                ref.hidden)

"""Scheduler: KV cache groups. A sliding-window group frees the blocks that fall out of its
window (a decoding sequence holds at most ceil(window / block_size) + 1 there), its prefix
hits need the window before the hit point, and preemption, chunked prefill and overlap keep
every answer. The fake worker reads each group's window back and checks every slot."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pocketllm.errors import UnsupportedFeatureError
from pocketllm.proto.messages import NULL_BLOCK, CacheGroup, CacheSpec
from pocketllm.scheduler.kv_groups import CacheGroups
from pocketllm.scheduler.scheduler import Scheduler
from test_scheduler_harness import (Driver, config, make_request, random_requests,
                                    run_matching_solo, sliding_config, solo, staggered)


def held(req, group=1):
    return sum(b != NULL_BLOCK for b in req.block_ids[group])


def test_a_long_sequence_holds_only_its_window_in_the_sliding_group():
    window, bs = 8, 4
    bound = -(-window // bs) + 1
    d = Driver(sliding_config(window, block_size=bs, max_model_len=512))
    prompt = list(range(10))
    d.add(make_request("a", prompt, max_tokens=200))
    most = 0
    while d.step() is not None:
        for req in d.sched.running:
            if req.num_computed_tokens > len(prompt):  # decoding
                assert held(req) <= bound, req
                most = max(most, held(req))
                assert held(req, 0) == len(req.block_ids[0])  # the full group keeps all
                assert d.sched.kv.pools[1].num_used_blocks == held(req)
    assert most == bound
    out = d.outcomes["a"]
    assert len(out.tokens) == 200
    assert out.tokens == solo(make_request("a", prompt, max_tokens=200)).tokens
    assert d.sched.stats()["kv_blocks_used"] == 0


def test_a_sliding_pool_smaller_than_the_context_serves_long_sequences():
    # Four sequences of 120 tokens each: 120 blocks in the full group, but a sliding pool of
    # 16 blocks is enough (3 each, while decoding) and nothing is preempted.
    d = Driver(sliding_config(8, sliding_blocks=16, block_size=4, num_kv_blocks=128,
                              max_model_len=256, max_num_batched_tokens=16))
    reqs = [make_request(f"r{i}", [i * 10 + j for j in range(4)], max_tokens=116) for i in range(4)]
    for r in reqs:
        d.add(r)
    outs = d.run()
    assert d.sched.stats()["preemptions"] == 0
    for r in reqs:
        assert outs[r.request_id].tokens == solo(r).tokens


@pytest.mark.parametrize("caching", [True, False])
def test_long_chunked_prefill_frees_behind_the_window(caching):
    window, bs = 8, 4
    d = Driver(sliding_config(window, block_size=bs, max_num_batched_tokens=12,
                              max_model_len=256, enable_prefix_caching=caching))
    prompt = list(range(100, 190))
    d.add(make_request("a", prompt, max_tokens=4))
    while d.step() is not None:
        for req in d.sched.running:
            # the window before the next chunk, that chunk, and (caching) the last chunk
            # until its result published it
            assert held(req) <= -(-window // bs) + 2 + 2 * -(-12 // bs), req
    assert d.outcomes["a"].tokens == solo(make_request("a", prompt, max_tokens=4)).tokens


def test_prefix_hit_with_the_window_still_cached():
    d = Driver(sliding_config(8, block_size=4))
    shared = list(range(40))
    d.add(make_request("a", shared + [500, 501], max_tokens=3))
    d.run()
    d.add(make_request("b", shared + [900, 901, 902], max_tokens=3))
    plan = d.step()
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 40
    # the sliding table: the blocks before the window are NULL, the window's are the cache's
    first = (40 - 8 + 1) // 4
    assert new.block_ids[1][:first] == [NULL_BLOCK] * first
    assert NULL_BLOCK not in new.block_ids[1][first:] and NULL_BLOCK not in new.block_ids[0]
    outs = d.run()
    assert outs["b"].cached == 40
    want = solo(make_request("b", shared + [900, 901, 902], max_tokens=3)).tokens
    assert outs["b"].tokens == want


def test_prefix_hit_shrinks_when_the_sliding_window_was_evicted():
    # The full pool keeps a's whole prefix; the sliding pool (small) has evicted the blocks
    # around its end for c's, so b's hit falls back to where the window is cached: none.
    d = Driver(sliding_config(8, sliding_blocks=12, block_size=4, num_kv_blocks=128,
                              max_model_len=256))
    shared = list(range(40))
    d.add(make_request("a", shared, max_tokens=2))
    d.run()
    d.add(make_request("c", list(range(600, 640)), max_tokens=2))
    d.run()
    d.add(make_request("b", shared + [7, 7, 7], max_tokens=3))
    plan = d.step()
    (new,) = plan.new_requests
    assert new.num_computed_tokens < 40
    # whatever the hit, the window before it is in the sliding table
    k = new.num_computed_tokens // 4
    first = max(0, new.num_computed_tokens - 8 + 1) // 4
    assert NULL_BLOCK not in new.block_ids[1][first:k]
    outs = d.run()
    assert outs["b"].tokens == solo(make_request("b", shared + [7, 7, 7], max_tokens=3)).tokens


def test_match_prefix_rule_directly():
    bs = 4
    groups = CacheGroups([CacheGroup(CacheSpec(), 32), CacheGroup(CacheSpec("sliding", 8), 32)],
                         bs, True)
    hashes = [bytes([i]) * 32 for i in range(10)]
    full, slide = groups.pools

    def publish(pool, indices):
        blocks = pool.allocate(len(indices))
        for b, i in zip(blocks, indices):
            pool.cache_block(b, hashes[i])
        pool.free(blocks)

    publish(full, range(10))
    publish(slide, [5, 6, 7])  # a hit of k blocks needs sliding blocks (4k-7)//4 .. k-1
    tables = groups.match_prefix(hashes)
    assert len(tables[0]) == len(tables[1]) == 8  # k=10, 9 miss block 8; k=8 needs 6, 7
    assert tables[1][:6] == [NULL_BLOCK] * 6
    publish(slide, [9])
    assert len(groups.match_prefix(hashes)[0]) == 8  # k=10 needs 8, 9: 8 is missing
    assert len(groups.match_prefix(hashes[:3])[0]) == 0  # k=3 needs 1, 2: not cached
    publish(slide, [0, 1])
    assert len(groups.match_prefix(hashes[:3])[0]) == 2  # k=2 needs 0, 1


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
def test_preemption_with_a_sliding_group_keeps_every_answer(caching, chunked):
    rng = random.Random(1)
    shared = [rng.randrange(1000) for _ in range(12)]
    reqs = []
    for i in range(8):
        tail = [rng.randrange(1000) for _ in range(rng.randrange(4, 13))]
        reqs.append(make_request(f"r{i}", (shared if i % 2 else []) + tail, max_tokens=40))
    d = Driver(sliding_config(6, sliding_blocks=16, block_size=4, num_kv_blocks=20,
                              max_num_seqs=8, max_num_batched_tokens=24,
                              enable_prefix_caching=caching, enable_chunked_prefill=chunked))
    run_matching_solo(d, reqs)
    assert d.sched.stats()["preemptions"] > 0
    assert d.sched.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("seed", range(3))
def test_overlapped_scheduling_with_a_sliding_group(seed):
    rng = random.Random(seed)
    reqs = [make_request(f"r{i}", [rng.randrange(1000) for _ in range(rng.randrange(3, 40))],
                         max_tokens=rng.randrange(5, 60)) for i in range(6)]
    d = Driver(sliding_config(8, sliding_blocks=24, block_size=4, num_kv_blocks=64,
                              max_num_batched_tokens=16, overlap=True))
    outs = d.run_overlapped(arrivals={0: reqs[:3], 5: reqs[3:]})
    for r in reqs:
        assert outs[r.request_id].tokens == solo(r).tokens, r.request_id
    assert d.sched.num_overlapped_steps > 0


def test_a_request_the_sliding_pool_cannot_hold_is_refused():
    cfg = sliding_config(64, sliding_blocks=8, block_size=4, num_kv_blocks=512,
                         max_model_len=256, max_num_batched_tokens=16)
    sched = Scheduler(cfg)
    error = sched.add_request(make_request("big", range(100), max_tokens=100))
    assert error is not None and error.kind == "too_long" and "sliding" in error.message
    # a short one fits: it never holds more than its own blocks
    assert sched.add_request(make_request("small", range(10), max_tokens=10)) is None


def test_an_unknown_cache_kind_is_refused():
    cfg = config()
    cfg.cache_groups = [CacheGroup(CacheSpec("bogus"), 8)]
    with pytest.raises(UnsupportedFeatureError, match="'bogus'"):
        Scheduler(cfg)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), block_size=st.sampled_from([1, 2, 4, 8]),
       window=st.integers(1, 20), num_reqs=st.integers(1, 8), budget=st.integers(1, 40),
       max_seqs=st.integers(1, 6), caching=st.booleans(), chunked=st.booleans(),
       overlap=st.booleans())
def test_random_workloads_with_a_sliding_group_match_solo_runs(
        seed, block_size, window, num_reqs, budget, max_seqs, caching, chunked, overlap):
    """Tight pools (preemption is common), shared prefixes, every switch: each answer is
    the one its request gets alone, and the fake worker finds every window's KV intact."""
    rng = random.Random(seed)
    max_model_len = 64
    reqs = random_requests(rng, num_reqs)
    probe = CacheGroups([CacheGroup(CacheSpec(), 1), CacheGroup(CacheSpec("sliding", window), 1)],
                        block_size, caching)
    chunk = budget if chunked else max_model_len
    limits = [min(len(r.prompt_token_ids) + r.sampling.max_tokens, max_model_len) for r in reqs]
    full = max(probe.rules[0].max_blocks(n, chunk) for n in limits)
    sliding = max(probe.rules[1].max_blocks(n, chunk) for n in limits)
    d = Driver(sliding_config(window, sliding_blocks=sliding + rng.randrange(0, 4),
                              block_size=block_size, num_kv_blocks=full + rng.randrange(0, full),
                              max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                              max_model_len=max_model_len, enable_prefix_caching=caching,
                              enable_chunked_prefill=chunked, overlap=overlap and chunked))
    outs = d.run_overlapped(arrivals=staggered(rng, reqs))
    for r in reqs:
        assert outs[r.request_id].tokens == solo(r, max_model_len=max_model_len).tokens
    assert d.sched.stats()["kv_blocks_used"] == 0

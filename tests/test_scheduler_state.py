"""Scheduler: a recurrent-state cache group (``CacheSpec("state")``, Gated DeltaNet's
layers, issue 35). A request holds one slot of the group's pool from admission to its end,
whatever its length; the slots bound how many run at once; preemption frees the slot and the
recompute starts again from position 0; a prefix is never served from the cache while a
state group exists (the state at its boundary is not kept). The fake worker keeps each
slot's state as a hash of the tokens it took in and checks, at every chunk, that the slot
holds exactly the request's own earlier tokens (zeros at position 0)."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pocketllm.proto.messages import CacheGroup, CacheSpec
from pocketllm.scheduler.block_manager import blocks_for
from pocketllm.scheduler.kv_groups import CacheGroups
from pocketllm.scheduler.scheduler import Scheduler
from test_scheduler_harness import (Driver, config, make_request, random_requests,
                                    run_matching_solo, solo, staggered)


def state_config(slots: int, **kw):
    """A full attention group and a state group of ``slots`` slots."""
    cfg = config(**kw)
    cfg.cache_groups = [CacheGroup(CacheSpec(), cfg.num_kv_blocks), CacheGroup(CacheSpec("state"), slots)]
    return cfg


def test_each_running_request_holds_one_slot_and_the_slots_bound_concurrency():
    d = Driver(state_config(2, max_num_batched_tokens=64))
    reqs = [make_request(f"r{i}", [i * 7 + j for j in range(5 + 3 * i)], max_tokens=20)
            for i in range(5)]
    for r in reqs:
        d.add(r)
    most = 0
    while d.step() is not None:
        running = d.sched.running
        most = max(most, len(running))
        slots = [r.block_ids[1] for r in running]
        assert all(len(s) == 1 for s in slots) and len({s[0] for s in slots}) == len(slots)
    assert most == 2
    for r in reqs:
        assert d.outcomes[r.request_id].tokens == solo(r).tokens
    assert d.sched.kv.pools[1].num_free_blocks == 2
    assert d.sched.stats()["kv_blocks_used"] == 0  # state slots are not KV blocks


@pytest.mark.parametrize("chunked", [True, False])
def test_preemption_frees_the_slot_and_the_recompute_starts_from_zero(chunked):
    rng = random.Random(4)
    reqs = [make_request(f"r{i}", [rng.randrange(1000) for _ in range(rng.randrange(4, 14))],
                         max_tokens=40) for i in range(6)]
    d = Driver(state_config(4, block_size=4, num_kv_blocks=20, max_num_batched_tokens=12,
                            enable_chunked_prefill=chunked))
    run_matching_solo(d, reqs)
    assert d.sched.stats()["preemptions"] > 0


def test_a_shared_prefix_is_computed_again_with_a_state_group():
    shared = list(range(100, 140))
    d = Driver(state_config(4, enable_prefix_caching=True))
    first = make_request("a", shared + [1, 2], max_tokens=5)
    d.add(first)
    d.run()
    second = make_request("b", shared + [3, 4], max_tokens=5)
    d.add(second)
    outs = d.run()
    assert outs["b"].cached == 0
    assert outs["b"].tokens == solo(second).tokens
    assert d.worker.computed["b"] == len(second.prompt_token_ids) + 4


@pytest.mark.parametrize("seed", range(3))
def test_overlapped_scheduling_with_a_state_group(seed):
    rng = random.Random(seed)
    reqs = [make_request(f"r{i}", [rng.randrange(1000) for _ in range(rng.randrange(3, 40))],
                         max_tokens=rng.randrange(5, 60)) for i in range(6)]
    d = Driver(state_config(3, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16,
                            overlap=True))
    outs = d.run_overlapped(arrivals={0: reqs[:3], 5: reqs[3:]})
    for r in reqs:
        assert outs[r.request_id].tokens == solo(r).tokens, r.request_id
    assert d.sched.num_overlapped_steps > 0


def test_a_layout_without_a_slot_or_without_positions_is_an_error():
    with pytest.raises(ValueError, match="positive"):
        Scheduler(state_config(0))
    with pytest.raises(ValueError, match="positions"):
        CacheGroups([CacheGroup(CacheSpec("state"), 4)], 4, False)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), block_size=st.sampled_from([1, 2, 4, 8]),
       slots=st.integers(1, 5), num_reqs=st.integers(1, 8), budget=st.integers(1, 40),
       max_seqs=st.integers(1, 6), caching=st.booleans(), chunked=st.booleans(),
       overlap=st.booleans())
def test_random_workloads_with_a_state_group_match_solo_runs(
        seed, block_size, slots, num_reqs, budget, max_seqs, caching, chunked, overlap):
    """Tight pools (preemption is common), shared prefixes, every switch: each answer is
    the one its request gets alone, and every slot holds its own request's state."""
    rng = random.Random(seed)
    max_model_len = 64
    reqs = random_requests(rng, num_reqs)
    full = max(blocks_for(min(len(r.prompt_token_ids) + r.sampling.max_tokens, max_model_len),
                          block_size) for r in reqs)
    d = Driver(state_config(slots, block_size=block_size, num_kv_blocks=full + rng.randrange(0, full),
                            max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                            max_model_len=max_model_len, enable_prefix_caching=caching,
                            enable_chunked_prefill=chunked, overlap=overlap and chunked))
    outs = d.run_overlapped(arrivals=staggered(rng, reqs))
    for r in reqs:
        assert outs[r.request_id].tokens == solo(r, max_model_len=max_model_len).tokens
        assert outs[r.request_id].cached == 0
    assert d.sched.kv.pools[1].num_free_blocks == slots

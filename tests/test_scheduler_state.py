"""Scheduler: a recurrent-state cache group (``CacheSpec("state")``, Gated DeltaNet's
layers, issue 35). A request holds one slot of the group's pool from admission to its end,
whatever its length; the slots bound how many run at once; preemption frees the slot and the
recompute starts again from position 0; with prefix caching a prompt's chunks stop on its
last block boundary and leave snapshots there, and a prefix is served from the cache only
where a snapshot of the state at its boundary exists, copied into the request's slot. The
fake worker keeps each slot's state as a hash of the tokens it took in and checks, at
every chunk, that the slot holds exactly the request's own earlier tokens (zeros at
position 0), so a hit read from the wrong snapshot, or from a fresh slot, fails."""

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


def test_a_shared_prefix_resumes_from_the_snapshot_at_its_last_boundary():
    """40 shared tokens, blocks of 4, a 32-token budget: the first prompt (42 tokens) runs
    in chunks of 32 and 10 and leaves snapshots at 32 (its first chunk's end) and 40 (its
    last boundary, taken inside the second chunk); the second is served 40 tokens from the
    cache, its slot a copy of the snapshot at 40.
    Without prefix caching nothing is kept."""
    shared = list(range(100, 140))
    for caching in (True, False):
        d = Driver(state_config(4, enable_prefix_caching=caching))
        first = make_request("a", shared + [1, 2], max_tokens=5)
        d.add(first)
        d.run()
        second = make_request("b", shared + [3, 4], max_tokens=5)
        d.add(second)
        outs = d.run()
        assert outs["b"].cached == (40 if caching else 0)
        assert outs["b"].tokens == solo(second).tokens
        assert d.worker.computed["b"] == len(second.prompt_token_ids) - outs["b"].cached + 4
        # once the steps are done, the snapshots are the pool's cached slots
        assert d.sched.kv.pools[1].num_cached_free_blocks == (2 if caching else 0)


def test_a_hit_mid_conversation_and_a_snapshot_evicted_first_used_last():
    """A second turn that extends the first resumes at the first turn's last boundary; a
    pool of two slots keeps one snapshot beside a running request, and a newer prompt's
    snapshot evicts the older one (least recently used)."""
    bs = 4
    d = Driver(state_config(2, block_size=bs, enable_prefix_caching=True, max_num_seqs=1))
    turn1 = make_request("t1", list(range(10, 31)), max_tokens=3)  # 21 tokens: boundary 20
    d.add(turn1)
    out1 = d.run()["t1"]
    turn2 = make_request("t2", list(range(10, 31)) + out1.tokens + [7, 8, 9], max_tokens=3)
    d.add(turn2)
    out2 = d.run()["t2"]
    assert out2.cached == 20 and out2.tokens == solo(turn2).tokens
    other = make_request("o", list(range(200, 213)), max_tokens=2)  # boundary 12
    d.add(other)
    d.run()
    again = make_request("t3", list(range(10, 31)) + [1], max_tokens=2)
    d.add(again)
    assert d.run()["t3"].cached == 0  # t2's snapshot went for o's


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
    the one its request gets alone, and every slot holds its own request's state (hits
    included: the fake worker checks each restored slot)."""
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
        assert caching or outs[r.request_id].cached == 0
    assert d.sched.kv.pools[1].num_free_blocks == slots


def test_a_shared_system_prompt_resumes_at_the_last_snapshot_point_inside_it(monkeypatch):
    """Prompts leave a snapshot every STATE_SNAPSHOT_TOKENS (here 16) and at their last
    boundary, inside one step: a second prompt sharing 38 tokens resumes at 32, the last
    point inside the shared part, though the first ran in one chunk."""
    from pocketllm.scheduler import kv_groups

    monkeypatch.setattr(kv_groups, "STATE_SNAPSHOT_TOKENS", 16)
    shared = list(range(300, 338))
    d = Driver(state_config(4, enable_prefix_caching=True, max_num_batched_tokens=64))
    first = make_request("a", shared + [1, 2, 3], max_tokens=3)
    d.add(first)
    d.run()
    assert d.worker.computed["a"] == 41 + 2  # one chunk (snapshots at 16, 32, 40), 2 decodes
    second = make_request("b", shared + [9, 8, 7, 6], max_tokens=3)
    d.add(second)
    out = d.run()["b"]
    assert out.cached == 32 and out.tokens == solo(second).tokens


def test_a_prefix_matched_beyond_any_snapshot_leaves_one_for_the_next_prompt():
    """A system prompt of 42 tokens (blocks of 4) then different questions: the first
    request leaves snapshots only past it (its own last boundary); the second matches 40
    tokens of cached KV but no snapshot there, so it computes from 0 and leaves one at 40
    (``snapshot_hint``); the third resumes at 40. Each answer is the one computed alone."""
    system = list(range(400, 442))
    d = Driver(state_config(6, enable_prefix_caching=True, max_num_batched_tokens=256))
    cached = []
    for i, question in enumerate(([1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5], [5, 5, 6, 6, 7])):
        req = make_request(f"q{i}", system + question, max_tokens=3)
        d.add(req)
        out = d.run()[f"q{i}"]
        assert out.tokens == solo(req).tokens
        cached.append(out.cached)
    assert cached == [0, 0, 40]

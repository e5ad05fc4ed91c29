"""Overlapped scheduling: step N+1 planned while step N runs gives the same tokens."""

import random

import pytest

from pocketllm.proto.messages import PENDING
from test_scheduler_harness import Driver, config, make_request


def workload(seed: int) -> dict[int, list]:
    """Requests arriving over time: mixed prompt lengths and budgets, shared prefixes,
    EOS ids that some sequences hit, a penalty request (it needs its tokens: no overlap
    while it samples)."""
    rng = random.Random(seed)
    arrivals: dict[int, list] = {}
    base = [rng.randrange(1000) for _ in range(24)]
    for i in range(14):
        prompt = (base[:rng.choice([0, 8, 16])] +
                  [rng.randrange(1000) for _ in range(rng.randrange(1, 30))])
        extra = {"frequency_penalty": 0.5} if i == 5 else {}
        req = make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 40),
                           eos=tuple(rng.sample(range(1000), 40)), **extra)
        arrivals.setdefault(rng.randrange(0, 60), []).append(req)
    return arrivals


def run(overlap: bool, seed: int, **cfg):
    d = Driver(config(overlap=overlap, num_kv_blocks=96, max_num_seqs=6, **cfg))
    out = d.run_overlapped(arrivals=workload(seed))
    return d, {rid: (o.tokens, o.finish_reason, o.hidden) for rid, o in out.items()}


@pytest.mark.parametrize("seed", range(4))
def test_overlap_gives_the_tokens_of_the_synchronous_loop(seed):
    _, sync = run(False, seed)
    d, overlapped = run(True, seed)
    assert overlapped == sync
    ahead = [p for p in d.plans if any(PENDING in c.new_token_ids for c in p.cached_requests)]
    assert len(ahead) > 10, "the overlap path was hardly exercised"
    assert sum(p.next_follows for p in d.plans) > len(d.plans) // 3


def test_no_plan_ahead_while_a_penalty_request_samples():
    d = Driver(config(overlap=True))
    d.add(make_request("p", range(10), max_tokens=6, presence_penalty=1.0))
    d.run_overlapped()
    assert d.outcomes["p"].finish_reason == "length"
    assert not any(p.next_follows for p in d.plans)


def test_plan_ahead_off_by_default():
    d = Driver(config())
    d.add(make_request("a", range(10), max_tokens=6))
    d.run_overlapped()
    assert not any(p.next_follows for p in d.plans)


def test_overlap_keeps_the_prefix_cache_of_generated_tokens():
    """A multi-turn follow-up (prompt = the last prompt + its answer) hits the cache as
    much with overlap as without: blocks are hashed only over real tokens, never over a
    placeholder still in flight."""
    hits = {}
    for overlap in (False, True):
        # 11 prompt tokens in chunks of 8: the second chunk, planned ahead, samples into
        # position 11, so the block of tokens 8..11 is full with a placeholder in it.
        d = Driver(config(overlap=overlap, block_size=4, num_kv_blocks=64,
                          max_num_batched_tokens=8))
        d.add(make_request("turn1", range(10, 21), max_tokens=9))
        first = d.run_overlapped()["turn1"].tokens
        d.add(make_request("turn2", list(range(10, 21)) + first + [5, 6], max_tokens=2))
        d.run_overlapped()
        hits[overlap] = d.sched.prefix_cache_hits
    assert hits[True] == hits[False] == 16


def test_step_loop_times_the_oldest_unanswered_step_and_profiles_paths():
    """The heartbeat's view of a step in flight (its age, and what steps of its size took
    lately) and the per-path step counts come from the stage's own StepLoop."""
    from pocketllm.proto.messages import StepResult
    from pocketllm.scheduler.step_loop import StepLoop

    now = [0.0]
    sent = []

    class IO:
        def drain(self, block): pass
        def send_plan(self, plan): sent.append(plan)
        def emit(self, batch): pass
        def report_grammar_errors(self, errors): raise AssertionError(errors)
        def publish_stats(self, force): pass

    d = Driver(config())
    d.add(make_request("a", range(10), max_tokens=3))
    loop = StepLoop(d.sched, IO(), clock=lambda: now[0])
    assert loop.oldest_unanswered() == (0.0, 0.0)
    loop._plan(promised=False)
    [first] = sent
    now[0] = 2.0
    assert loop.oldest_unanswered() == (2.0, 0.0)  # no step has been timed yet
    result = d.worker.step(first)
    result.path, result.launch_ms, result.device_ms = "eager", 1.5, {"eager": 4.0}
    loop.receive(result)
    assert loop.oldest_unanswered() == (0.0, 0.0)
    loop.step()  # applies the result
    loop._plan(promised=False)  # the decode
    assert len(sent) == 2
    now[0] = 3.0
    assert loop.oldest_unanswered() == (1.0, 0.2)  # 2 s for 10 tokens: 0.2 s per token
    assert loop.profile() == {"steps_by_path": {"eager": 1},
                              "step_launch_ms_by_path": {"eager": 1.5},
                              "step_device_ms_by_path": {"eager": 4.0}}

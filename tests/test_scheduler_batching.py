"""Scheduler: continuous batching, chunked prefill, finishes, aborts, errors, refusals."""

import pytest

from pocketllm.errors import InvalidRequestError
from pocketllm.proto.messages import StepResult
from pocketllm.scheduler.scheduler import Scheduler
from test_scheduler_harness import Driver, config, make_request, next_token, solo


def expected_tokens(prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def counts(plan):
    ids = [r.request_id for r in plan.new_requests] + [r.request_id for r in plan.cached_requests]
    return dict(zip(ids, plan.num_scheduled_tokens))


def test_single_request_generates_what_the_model_says():
    d = Driver(config())
    d.add(make_request("a", range(1, 11), max_tokens=5))
    out = d.run()["a"]
    assert out.tokens == expected_tokens(list(range(1, 11)), 5)
    assert out.finish_reason == "length" and out.prompt_len == 10
    assert d.sched.stats()["kv_blocks_used"] == 0


def test_continuous_batching_mixes_decode_and_prefill():
    d = Driver(config(max_num_batched_tokens=64))
    d.add(make_request("a", range(10), max_tokens=6))
    first = d.step()
    assert counts(first) == {"a": 10} and first.new_requests[0].num_computed_tokens == 0
    d.add(make_request("b", range(100, 120), max_tokens=3))
    second = d.step()
    assert counts(second) == {"b": 20, "a": 1}  # a decodes while b prefills
    (a_diff,) = second.cached_requests
    assert a_diff.request_id == "a" and a_diff.num_computed_tokens == 10
    assert a_diff.new_token_ids == d.outcomes["a"].tokens[:1]  # only the token sampled since
    assert second.new_requests[0].token_ids == list(range(100, 120))
    outs = d.run()
    assert outs["a"].tokens == expected_tokens(list(range(10)), 6)
    assert outs["b"].tokens == expected_tokens(list(range(100, 120)), 3)


def test_decodes_go_first_and_prefill_takes_the_rest_of_the_budget():
    d = Driver(config(max_num_batched_tokens=16))
    for i in range(3):
        d.add(make_request(f"d{i}", [i + 1] * 3, max_tokens=20))
    d.step()
    d.add(make_request("long", range(40), max_tokens=2))
    plan = d.step()
    assert counts(plan) == {"long": 13, "d0": 1, "d1": 1, "d2": 1}


def test_chunked_prefill_splits_a_long_prompt():
    d = Driver(config(max_num_batched_tokens=32, block_size=8))
    prompt = list(range(100))
    d.add(make_request("long", prompt, max_tokens=1))
    outs = d.run()
    assert [p.num_scheduled_tokens for p in d.plans] == [[32], [32], [32], [4]]
    assert [p.cached_requests[0].num_computed_tokens for p in d.plans[1:]] == [32, 64, 96]
    assert d.worker.computed["long"] == 100  # each prompt token computed exactly once
    assert outs["long"].tokens == expected_tokens(prompt, 1)


def test_without_chunking_prompts_run_whole():
    d = Driver(config(max_num_batched_tokens=32, enable_chunked_prefill=False))
    d.add(make_request("big", range(50), max_tokens=2))  # over the budget: alone, whole
    d.add(make_request("small", range(200, 220), max_tokens=2))
    d.add(make_request("small2", range(30, 45), max_tokens=2))
    plans = [d.step() for _ in range(2)]
    assert counts(plans[0]) == {"big": 50}  # small waits: big is this step's only prefill
    assert counts(plans[1]) == {"small": 20, "big": 1}  # small2 (15) does not fit 32-1-20
    assert counts(d.step()) == {"small2": 15, "small": 1}
    outs = d.run()
    assert outs["big"].tokens == expected_tokens(list(range(50)), 2)


def test_max_num_seqs_caps_running():
    d = Driver(config(max_num_seqs=2))
    for i in range(4):
        d.add(make_request(f"r{i}", [i] * 5, max_tokens=3))
    assert set(counts(d.step())) == {"r0", "r1"}
    assert d.sched.stats()["running"] == 2 and d.sched.stats()["waiting"] == 2
    outs = d.run()
    assert all(o.finish_reason == "length" and len(o.tokens) == 3 for o in outs.values())


def test_eos_is_hidden_counted_and_stops():
    prompt = [5, 6, 7]
    toks = expected_tokens(prompt, 4)
    d = Driver(config())
    d.add(make_request("e", prompt, max_tokens=10, eos=(toks[2],)))
    d.add(make_request("ignore", prompt, max_tokens=4, eos=(toks[2],), ignore_eos=True))
    d.add(make_request("stop_id", prompt, max_tokens=10, stop_token_ids=[toks[1]]))
    outs = d.run()
    assert outs["e"].tokens == toks[:2] and outs["e"].finish_reason == "stop"
    assert outs["e"].hidden == 1
    assert outs["ignore"].tokens == toks and outs["ignore"].finish_reason == "length"
    assert outs["stop_id"].tokens == toks[:1] and outs["stop_id"].hidden == 1
    assert outs["stop_id"].finish_reason == "stop"


def test_max_model_len_gives_length():
    d = Driver(config(max_model_len=12))
    d.add(make_request("m", range(9), max_tokens=100))
    out = d.run()["m"]
    assert len(out.tokens) == 3 and out.finish_reason == "length"


def test_refused_up_front():
    s = Scheduler(config(num_kv_blocks=8, block_size=4, max_model_len=64))
    def refusal(req):
        err = s.add_request(req)
        return err.message, err.kind, err.param

    assert refusal(make_request("long", range(64)))[1:] == ("too_long", "prompt")
    assert "max_model_len" in refusal(make_request("long", range(64)))[0]
    big = refusal(make_request("big", range(20), max_tokens=13))
    assert "KV blocks" in big[0] and big[1:] == ("too_long", "max_tokens")
    assert s.add_request(make_request("fits", range(20), max_tokens=12)) is None  # 32 tokens
    used = refusal(make_request("fits", range(3)))
    assert "already in use" in used[0] and used[1:] == ("conflict", "request_id")
    empty = refusal(make_request("empty", []))
    assert "empty" in empty[0] and empty[1:] == ("invalid_request", "prompt")
    zero = refusal(make_request("zero", [1], max_tokens=0))
    assert "max_tokens" in zero[0] and zero[1:] == ("invalid_request", "max_tokens")
    assert s.stats()["waiting"] == 1
    with pytest.raises(InvalidRequestError):
        config(max_num_seqs=0)


def test_abort_running_and_waiting_frees_blocks():
    d = Driver(config(max_num_seqs=1))
    d.add(make_request("run", range(10), max_tokens=50))
    d.add(make_request("wait", range(10), max_tokens=50))
    d.step()
    d.step()
    assert d.sched.stats()["kv_blocks_used"] > 0
    batch = d.sched.abort(["run", "wait", "unknown"])
    d.collect(batch)
    assert [x.request_id for x in batch.new_requests] == ["wait"]  # announced with its delta
    assert {x.request_id: x.finish_reason for x in batch.deltas} == {"run": "abort", "wait": "abort"}
    assert d.sched.stats()["kv_blocks_used"] == 0 and not d.sched.has_unfinished()
    d.sched.check_invariants()
    assert d.sched.abort(["run"]).deltas == []  # finished ids are ignored
    d.add(make_request("next", [1, 2], max_tokens=1))
    plan = d.step()
    assert plan.finished_request_ids == ["run"]  # the rank drops it (the worker asserts it knew it)
    assert d.run()["next"].finish_reason == "length"


def test_abort_between_schedule_and_update_drops_the_token():
    d = Driver(config())
    d.add(make_request("a", range(6), max_tokens=10))
    d.add(make_request("b", range(6), max_tokens=3))
    d.step()
    d.step(between=lambda plan: d.collect(d.sched.abort(["a"])))
    assert d.outcomes["a"].tokens == expected_tokens(list(range(6)), 1)
    assert d.outcomes["a"].finish_reason == "abort"
    assert d.run()["b"].tokens == expected_tokens(list(range(6)), 3)
    assert d.sched.stats()["kv_blocks_used"] == 0


def test_a_stop_matched_downstream_ends_the_request_silently():
    d = Driver(config())
    d.add(make_request("s", range(6), max_tokens=10))
    d.step()
    assert d.sched.stop(["s", "unknown"]) is None  # no final delta: the detokenizer sent it
    assert not d.sched.is_active("s") and d.sched.stats()["kv_blocks_used"] == 0


def test_failed_forward_fails_the_step_and_scheduler_goes_on():
    d = Driver(config(max_num_seqs=2))
    d.add(make_request("a", range(6), max_tokens=4))
    d.add(make_request("b", range(7), max_tokens=4))
    d.add(make_request("c", range(8), max_tokens=4))  # waits for a seat: not in the failed step
    d.step()
    d.worker.fail_next = True
    d.step()
    for rid in ("a", "b"):
        assert d.outcomes[rid].finish_reason == "error"
        assert d.outcomes[rid].error == "simulated forward failure"
    outs = d.run()
    assert outs["c"].tokens == expected_tokens(list(range(8)), 4)
    assert d.sched.stats()["kv_blocks_used"] == 0


def test_missing_token_fails_only_that_request():
    d = Driver(config())
    d.add(make_request("a", range(6), max_tokens=4))
    d.add(make_request("b", range(7), max_tokens=4))
    plan = d.sched.schedule()
    good = d.worker.step(plan)
    i = good.request_ids.index("a")
    bad = StepResult(plan.step_id, [good.request_ids[1 - i]], [good.token_ids[1 - i]])
    d.collect(d.sched.update(plan, bad))
    assert d.outcomes["a"].finish_reason == "error" and d.outcomes["b"].finish_reason is None
    d.sched.check_invariants()


def test_logprobs_travel_with_their_token():
    d = Driver(config())
    d.worker.logprobs = True
    d.add(make_request("l", range(5), max_tokens=3, logprobs=1))
    d.run()
    assert d.outcomes["l"].tokens == expected_tokens(list(range(5)), 3)


def test_protocol_misuse_raises():
    d = Driver(config())
    d.add(make_request("a", range(5)))
    plan = d.sched.schedule()
    with pytest.raises(RuntimeError):
        d.sched.schedule()
    result = d.worker.step(plan)
    with pytest.raises(ValueError):
        d.sched.update(plan, StepResult(plan.step_id + 1))
    d.sched.update(plan, result)
    with pytest.raises(RuntimeError):
        d.sched.update(plan, result)
    assert d.sched.schedule() is not None


def test_solo_helper_matches_model():
    assert solo(make_request("x", [3, 1, 4], max_tokens=4)).tokens == expected_tokens([3, 1, 4], 4)


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _batching_driver(delay: float = 0.05):
    d = Driver(config(max_num_batched_tokens=64, admission_delay_s=delay))
    d.sched.clock = clock = _Clock()
    d.add(make_request("a", range(10), max_tokens=50))
    d.step()  # a prefills alone: nothing was running, so no wait
    return d, clock


def test_admission_batching_holds_a_short_prompt_while_decodes_run_until_the_delay():
    d, clock = _batching_driver()
    d.add(make_request("b", range(100, 120), max_tokens=3))
    assert counts(d.step()) == {"a": 1}  # b waits: the decode step stays decode-only
    clock.now += 0.049
    assert counts(d.step()) == {"a": 1}
    clock.now += 0.002  # b has now waited past the delay
    assert counts(d.step()) == {"a": 1, "b": 20}


def test_admission_batching_admits_once_the_waiting_prompts_fill_the_step():
    d, clock = _batching_driver()
    d.add(make_request("b", range(100, 130), max_tokens=3))
    assert counts(d.step()) == {"a": 1}
    d.add(make_request("c", range(200, 240), max_tokens=3))  # 30 + 40 tokens >= budget 63
    assert counts(d.step()) == {"a": 1, "b": 30, "c": 33}
    assert clock.now == 100.0  # no time passed: the budget alone released them


def test_admission_batching_off_admits_at_once():
    d, _clock = _batching_driver(delay=0.0)
    d.add(make_request("b", range(100, 120), max_tokens=3))
    assert counts(d.step()) == {"a": 1, "b": 20}


def test_admission_batching_counts_only_the_prompts_free_slots_can_take():
    d = Driver(config(max_num_batched_tokens=64, max_num_seqs=2, admission_delay_s=0.05))
    d.sched.clock = clock = _Clock()
    d.add(make_request("a", range(10), max_tokens=50))
    d.step()
    for name, start in (("b", 100), ("c", 200), ("d", 300)):  # 90 waiting tokens, 1 free slot
        d.add(make_request(name, range(start, start + 30), max_tokens=3))
    assert counts(d.step()) == {"a": 1}  # one slot takes 30 tokens: not a full step yet
    clock.now += 0.06
    assert counts(d.step()) == {"a": 1, "b": 30}


def test_the_scheduler_is_configured_from_the_worker_declaration():
    """Chunking and prefix caching follow what the worker declared; a worker without paged
    KV or continuous batching is refused with a typed error, not scheduled for."""
    import pytest

    from pocketllm.errors import UnsupportedFeatureError
    from pocketllm.proto.messages import WorkerCapabilities
    from pocketllm.scheduler.config import config_from_capabilities

    caps = WorkerCapabilities(device="cpu", dtype="float32", architecture="LlamaForCausalLM",
                              block_size=16, num_kv_blocks=10, max_num_seqs=4,
                              max_model_len=128, vocab_size=100, chunked_prefill=False,
                              prefix_caching=False)
    cfg = config_from_capabilities(caps, 64, admission_delay_s=0.05, overlap=True)
    assert (cfg.block_size, cfg.num_kv_blocks, cfg.max_num_seqs, cfg.max_model_len) == (16, 10, 4, 128)
    assert not cfg.enable_chunked_prefill and not cfg.enable_prefix_caching
    assert cfg.admission_delay_s == 0.0 and cfg.overlap  # no graphs: nothing to batch for
    caps.cuda_graph_batch_sizes = [1, 2]
    assert config_from_capabilities(caps, 64, 0.05, False).admission_delay_s == 0.05
    caps.paged_kv = False
    with pytest.raises(UnsupportedFeatureError, match="paged_kv"):
        config_from_capabilities(caps, 64, 0.05, False)

"""ModelRunner step semantics: chunked prefill, batching, block tables, prefix hits, errors."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from pocketllm.config import EngineArgs  # noqa: E402
from pocketllm.errors import UnsupportedFeatureError  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.proto.messages import (CachedRequestData, NewRequestData, SamplingSpec,  # noqa: E402
                                      StepPlan)
from pocketllm.workers import kv_plan  # noqa: E402
from pocketllm.workers.runner import ModelRunner  # noqa: E402
from tiny_checkpoints import PlanDriver, make_tiny_checkpoint, run_step, tables  # noqa: E402

GREEDY = SamplingSpec(temperature=0.0)
PROMPT_A = [random.Random(1).randrange(3, 512) for _ in range(21)]
PROMPT_B = [random.Random(2).randrange(3, 512) for _ in range(13)]


@pytest.fixture(scope="module", params=["gemma3", "qwen3"])
def runner(request, tmp_path_factory):
    path = make_tiny_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))
    args = EngineArgs(model=path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=48)
    return ModelRunner(load_model_info(args), args)


def generate(runner, prompts: dict, new_tokens=12, chunk=None, shuffle=None) -> dict:
    driver = PlanDriver(runner, chunk=chunk, shuffle_blocks=shuffle)
    for rid, prompt in prompts.items():
        driver.add(rid, prompt, GREEDY, new_tokens)
    return driver.run()


def test_chunked_prefill_equals_one_shot(runner):
    one_shot = generate(runner, {"a": PROMPT_A})["a"]
    assert generate(runner, {"a": PROMPT_A}, chunk=8)["a"] == one_shot  # 8 + 8 + 5
    assert generate(runner, {"a": PROMPT_A}, chunk=3)["a"] == one_shot


def test_batched_equals_alone(runner):
    alone_a = generate(runner, {"a": PROMPT_A})["a"]
    alone_b = generate(runner, {"b": PROMPT_B})["b"]
    both = generate(runner, {"a": PROMPT_A, "b": PROMPT_B})
    assert both == {"a": alone_a, "b": alone_b}
    # b prefills in chunks while a is already decoding: mixed steps
    driver = PlanDriver(runner, chunk=5)
    driver.add("a", PROMPT_A[:4], GREEDY, 12)
    driver.add("b", PROMPT_B, GREEDY, 12)
    short_alone = generate(runner, {"a": PROMPT_A[:4]})["a"]
    assert driver.run() == {"a": short_alone, "b": alone_b}


def test_shuffled_block_tables(runner):
    contiguous = generate(runner, {"a": PROMPT_A, "b": PROMPT_B})
    for seed in (0, 1):
        assert generate(runner, {"a": PROMPT_A, "b": PROMPT_B}, shuffle=seed) == contiguous


def test_preempted_request_recomputes_the_same(runner):
    alone = generate(runner, {"a": PROMPT_A})["a"]
    driver = PlanDriver(runner, shuffle_blocks=3)
    driver.add("a", PROMPT_A, GREEDY, 12)
    for _ in range(5):
        driver.step_once()
    driver.preempt("a")
    assert driver.run()["a"] == alone


def test_prefix_cache_hit(runner):
    """A new request whose first blocks are already in the cache computes only the rest."""
    bs = runner.block_size
    alone = generate(runner, {"b": PROMPT_A[:8] + PROMPT_B})["b"]
    shared_blocks = [30, 31]  # positions 0..7 of both requests
    first = StepPlan(step_id=0, new_requests=[
        NewRequestData("a", PROMPT_A, tables(runner, shared_blocks + [10, 11, 12, 13]), 0,
                       GREEDY)],
        num_scheduled_tokens=[len(PROMPT_A)])
    assert run_step(runner, first).error is None
    tokens = PROMPT_A[:8] + PROMPT_B
    blocks = shared_blocks + list(range(20, 20 + (len(tokens) - 8 + bs - 1) // bs + 1))
    plan = StepPlan(step_id=1, finished_request_ids=["a"], new_requests=[
        NewRequestData("b", tokens, tables(runner, blocks), 8, GREEDY)],
        num_scheduled_tokens=[len(tokens) - 8])
    result = run_step(runner, plan)
    assert result.error is None and result.token_ids == alone[:1]
    run_step(runner, StepPlan(step_id=2, finished_request_ids=["b"]))


def test_prefill_chunk_samples_nothing_and_decode_samples(runner):
    plan = StepPlan(step_id=0, new_requests=[
        NewRequestData("c", PROMPT_B, tables(runner, [0, 1, 2, 3]), 0, GREEDY)],
        num_scheduled_tokens=[6])
    assert run_step(runner, plan).request_ids == []
    plan = StepPlan(step_id=1, cached_requests=[CachedRequestData("c", [], tables(runner, []), 6)],
                    num_scheduled_tokens=[len(PROMPT_B) - 6])
    result = run_step(runner, plan)
    assert result.request_ids == ["c"] and len(result.token_ids) == 1 and result.logprobs == [None]
    run_step(runner, StepPlan(step_id=2, finished_request_ids=["c"]))


@pytest.mark.parametrize("plan", [  # each built for the runner's cache groups (``t``)
    lambda t: StepPlan(step_id=7, cached_requests=[CachedRequestData("ghost", [1], t([]), 3)],
                       num_scheduled_tokens=[1]),
    lambda t: StepPlan(step_id=7, new_requests=[NewRequestData("x", [5, 6, 7], t([10_000]), 0,
                                                               GREEDY)],
                       num_scheduled_tokens=[3]),
    lambda t: StepPlan(step_id=7, new_requests=[NewRequestData("x", [5, 6, 7], t([1]), 0, GREEDY)],
                       num_scheduled_tokens=[9]),
    lambda t: StepPlan(step_id=7, new_requests=[NewRequestData("x", [5, 6, 7], t([1]), 0, GREEDY)],
                       num_scheduled_tokens=[]),
    lambda t: StepPlan(step_id=7, new_requests=[NewRequestData("x", [5, 99999], t([1]), 0, GREEDY)],
                       num_scheduled_tokens=[2]),
    lambda t: StepPlan(step_id=7, new_requests=[NewRequestData("x", [5, 6, 7], t([1])[:1] * 3,
                                                               0, GREEDY)],
                       num_scheduled_tokens=[3]),
], ids=["unknown-request", "bad-block", "too-many-tokens", "count-mismatch", "bad-token",
        "table-per-group"])
def test_bad_plan_is_an_error_result_not_a_crash(runner, plan):
    result = run_step(runner, plan(lambda ids: tables(runner, ids)))
    assert result.step_id == 7 and result.error and not result.token_ids
    run_step(runner, StepPlan(step_id=8, finished_request_ids=["x"]))
    assert generate(runner, {"a": PROMPT_B}, new_tokens=2)["a"]  # still serving


def test_capabilities(runner):
    caps = runner.capabilities()
    assert (caps.device, caps.dtype, caps.block_size, caps.num_kv_blocks) == ("cpu", "float32", 4, 48)
    assert caps.vocab_size == 512 and caps.max_model_len == 512 and caps.load_seconds > 0
    assert caps.architecture in ("Gemma3ForCausalLM", "Qwen3ForCausalLM")
    # the roofline's bytes: all weights, but of an input embedding the LM head does not
    # share (Qwen3's here; Gemma's is its head) only the row a step looks up
    model = runner.model
    params = sum(p.numel() for p in model.parameters())
    table = model.embed_tokens.weight
    tied = model.lm_head.tied_to is not None
    assert tied == (caps.architecture == "Gemma3ForCausalLM")
    unread = 0 if tied else table.numel() - table.shape[1]
    assert caps.weight_bytes == 4 * (params - unread)


def test_kv_budget_rules():
    per_block = 1000

    def blocks(**kw):  # host memory's budget (no GPU's free bytes)
        return kv_plan.num_kv_blocks(EngineArgs(**kw), 64, per_block)

    assert blocks(num_kv_blocks=7) == 7  # explicit: exact
    assert blocks(kv_cache_memory_gb=1e-5, max_num_seqs=64) == int(1e-5 * (1 << 30)) // per_block
    # a byte budget never buys more than max_num_seqs full-length sequences (+ slack)
    assert blocks(kv_cache_memory_gb=1.0, max_num_seqs=2, block_size=16) == 2 * 4 + 4
    assert blocks(max_num_seqs=1, block_size=16) == 4 + 4  # CPU RAM share, capped the same way


def test_tensor_parallel_with_heads_that_do_not_split_is_refused(tmp_path):
    path = make_tiny_checkpoint("llama", str(tmp_path / "l"))  # 4 heads, 2 KV heads
    args = EngineArgs(model=path, device="cpu")
    with pytest.raises(UnsupportedFeatureError, match="num_attention_heads=4 is not divisible "
                                                      "by tensor_parallel_size=3"):
        ModelRunner(load_model_info(args), args, rank=0, world_size=3)

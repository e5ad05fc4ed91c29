"""Requests through the whole process graph on a tiny random checkpoint."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from pocketllm import (LLM, AsyncLLM, CheckpointError, EngineArgs, InvalidRequestError,
                       PromptTooLongError, SamplingParams, UnsupportedFeatureError)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LONG_PROMPT = "the quick brown fox jumps over the lazy dog and then " * 6


def test_generate_batch_and_token_prompts(llm_tiny):
    outs = llm_tiny.generate(["hello world", "a b c"], GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert all(len(o.token_ids) == 24 and o.usage.completion_tokens == 24 for o in outs)
    assert outs[0].usage.as_dict()["total_tokens"] == outs[0].usage.prompt_tokens + 24
    ids_out = llm_tiny.generate([5, 6, 7, 8], GREEDY)[0]
    assert ids_out.usage.prompt_tokens == 4 and len(ids_out.token_ids) == 24


def test_engine_stats_count_the_steps_by_path(llm_tiny):
    from pocketllm.bench.throughput import settled_stats

    before = settled_stats(llm_tiny)
    llm_tiny.generate("count my steps", SamplingParams(max_tokens=5, ignore_eos=True))
    after = settled_stats(llm_tiny, newer_than=before)
    steps = {path: n - before.steps_by_path.get(path, 0)
             for path, n in after.steps_by_path.items()}
    assert sum(steps.values()) == 5  # one prefill step and four decodes
    if llm_tiny.capabilities.device == "cpu":
        assert set(after.steps_by_path) == {"eager"}  # the CPU has no graphs
        # on the CPU a launch computes the step, and there is no device span to read
        launched = (after.step_launch_ms_by_path["eager"]
                    - before.step_launch_ms_by_path.get("eager", 0))
        assert 0 < launched < 60_000 and after.step_device_ms_by_path == {}
    else:  # CUDA: the decodes replay graphs, and every path has its device span
        assert steps.get("graph", 0) == 4
        assert set(after.step_device_ms_by_path) == set(after.steps_by_path)
        assert all(ms > 0 for ms in after.step_device_ms_by_path.values())


# Batch independence holds on the CPU path and, on CUDA, in batch-invariant mode
# (conftest.invariant_args; tests/test_batch_invariant.py tests the mode itself).


def test_greedy_is_deterministic_alone_and_batched(llm_invariant):
    alone = llm_invariant.generate(LONG_PROMPT, GREEDY)[0].token_ids
    batch = llm_invariant.generate(["other prompt"] * 3 + [LONG_PROMPT], GREEDY)
    assert batch[3].token_ids == alone


def test_seeded_sampling_independent_of_batch(llm_invariant):
    sp = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm_invariant.generate("seeded", sp)[0].token_ids
    noise = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    batch = llm_invariant.generate(["x", "seeded", "y"], [noise, sp, noise])
    assert batch[1].token_ids == alone
    other = llm_invariant.generate("seeded", SamplingParams(max_tokens=20, temperature=1.0,
                                                            seed=99, ignore_eos=True))[0].token_ids
    assert other != alone


@pytest.mark.parametrize("bad, param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-1), "temperature"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=5), "stop"),
])
def test_bad_sampling_params_are_typed_errors(bad, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**bad)
    assert e.value.param == param


def test_bad_prompts_refused_and_engine_keeps_serving(llm_tiny):
    vocab = llm_tiny.model_info.vocab_size
    with pytest.raises(InvalidRequestError):
        llm_tiny.generate("", GREEDY)
    with pytest.raises(InvalidRequestError):
        llm_tiny.generate([[]], GREEDY)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm_tiny.generate([1, 2, vocab + 5], GREEDY)
    with pytest.raises(PromptTooLongError):
        llm_tiny.generate([7] * (llm_tiny.model_info.max_model_len + 1), GREEDY)
    assert llm_tiny.generate("still fine", GREEDY)[0].finish_reason == "length"
    assert llm_tiny._client.num_active() == 0


def test_bad_engine_args_fail_before_loading(tmp_path):
    with pytest.raises(UnsupportedFeatureError):
        EngineArgs(backend="cpp")
    with pytest.raises(UnsupportedFeatureError):
        EngineArgs(backend="tensorrt")
    with pytest.raises(CheckpointError, match="not found"):
        LLM(EngineArgs(model=str(tmp_path / "missing")))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError):
        LLM(EngineArgs(model=str(tmp_path)))
    garbage = tmp_path / "model.gguf"
    garbage.write_bytes(b"NOTGGUF" * 10)
    with pytest.raises(CheckpointError, match="not a GGUF"):
        LLM(EngineArgs(model=str(garbage)))


@pytest.mark.parametrize("keep", [1 << 20, 200 << 20], ids=["in-header", "in-tensor-data"])
def test_truncated_gguf_is_a_checkpoint_error(default_model_path, tmp_path, keep):
    cut = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as f:
        cut.write_bytes(f.read(keep))
    with pytest.raises(CheckpointError):
        LLM(EngineArgs(model=str(cut)))


def test_unreadable_checkpoint(tiny_llama, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root can read a mode-000 file")
    bad = tmp_path / "ckpt"
    bad.mkdir(mode=0)
    with pytest.raises(CheckpointError):
        LLM(EngineArgs(model=str(bad)))


def test_from_env():
    args = EngineArgs.from_env({"POCKETLLM_MAX_NUM_SEQS": "3", "POCKETLLM_ENABLE_PREFIX_CACHING":
                                "false", "POCKETLLM_BACKEND_OPTIONS": '{"eos_token_id": 7}'},
                               seed=5)
    assert args.max_num_seqs == 3 and not args.enable_prefix_caching and args.seed == 5
    assert args.backend_options == {"eos_token_id": 7}
    with pytest.raises(InvalidRequestError):
        EngineArgs.from_env({"POCKETLLM_MAX_NUM_SEQS": "many"})
    with pytest.raises(InvalidRequestError, match="not one this engine acts on"):
        EngineArgs(backend_options={"cuda_graphs": True})  # never silently ignored


def test_cancel_mid_stream_frees_everything(llm_tiny):
    sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    stream = llm_tiny.generate_stream("cancel me", sp, request_id="to-cancel")
    events = []
    for event in stream:
        events.append(event)
        if len(events) == 3:
            assert llm_tiny.cancel("to-cancel") is True
    assert events[-1].finished and events[-1].finish_reason == "abort"
    assert len(events) < 100
    assert llm_tiny.cancel("to-cancel") is False
    assert llm_tiny.cancel("never-existed") is False
    assert llm_tiny._client.num_active() == 0


def test_abandoned_stream_is_aborted(llm_tiny):
    stream = llm_tiny.generate_stream("walk away", SamplingParams(max_tokens=400, ignore_eos=True),
                                      request_id="abandoned")
    next(stream)
    stream.close()
    deadline = threading.Event()
    for _ in range(100):
        if not llm_tiny._client.is_active("abandoned"):
            break
        deadline.wait(0.05)
    assert not llm_tiny._client.is_active("abandoned")


def test_stop_strings_stream_and_not(llm_tiny):
    full = llm_tiny.generate(LONG_PROMPT, GREEDY)[0].text
    assert len(full) > 12
    # a stop string taken from the middle of the greedy answer, likely spanning tokens
    stop = full[5:11]
    whole = llm_tiny.generate(LONG_PROMPT, SamplingParams(max_tokens=24, temperature=0.0,
                                                          ignore_eos=True, stop=[stop]))[0]
    assert whole.finish_reason == "stop"
    assert whole.text == full[:full.index(stop)]
    streamed = "".join(e.text for e in llm_tiny.generate_stream(
        LONG_PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                    stop=[stop])))
    assert streamed == whole.text


def test_chunked_prefill_matches_one_shot(tiny_llama, llm_invariant):
    from conftest import invariant_args

    prompt = LONG_PROMPT * 2
    chunked = llm_invariant.generate(prompt, GREEDY)[0]  # budget 64 tokens per step
    with LLM(EngineArgs(model=tiny_llama, max_num_batched_tokens=2048,
                        enable_prefix_caching=False, **invariant_args())) as one_shot:
        assert chunked.usage.prompt_tokens > 64
        assert one_shot.generate(prompt, GREEDY)[0].token_ids == chunked.token_ids


def test_prefix_cache_hit_is_counted_and_identical(llm_invariant):
    shared = "a shared system preamble that is long enough to fill blocks " * 4
    first = llm_invariant.generate(shared + "question one", GREEDY)[0]
    second = llm_invariant.generate(shared + "question two", GREEDY)[0]
    again = llm_invariant.generate(shared + "question one", GREEDY)[0]
    assert second.usage.cached_tokens >= 16
    assert again.usage.cached_tokens >= 16
    assert again.token_ids == first.token_ids


def test_preemption_under_tiny_kv_budget(tiny_llama, llm_invariant):
    from conftest import invariant_args

    prompts = [f"request number {i} " * 6 for i in range(8)]
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    alone = [llm_invariant.generate(p, sp)[0].text for p in prompts]
    with LLM(EngineArgs(model=tiny_llama, num_kv_blocks=24, max_num_seqs=8,
                        enable_prefix_caching=False, **invariant_args())) as small:
        together = small.generate(prompts, sp)
    assert [o.text for o in together] == alone


def test_chat_uses_checkpoint_template(llm_tiny):
    out = llm_tiny.chat([{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                        SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.usage.prompt_tokens > 4 and out.finish_reason in ("stop", "length")
    with pytest.raises(InvalidRequestError):
        llm_tiny.chat([{"role": "wizard", "content": "x"}])
    with pytest.raises(InvalidRequestError):
        llm_tiny.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(InvalidRequestError):  # not a tool definition
        llm_tiny.chat([{"role": "user", "content": "x"}], tools=[{"type": "function"}])
    with pytest.raises(UnsupportedFeatureError) as e:  # this template teaches no call syntax
        llm_tiny.chat([{"role": "user", "content": "x"}],
                      tools=[{"type": "function", "function": {"name": "f"}}])
    assert e.value.param == "tools"


def test_chat_does_not_mutate_the_callers_messages(llm_tiny):
    import copy

    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]}]
    before = copy.deepcopy(messages)
    llm_tiny.chat(messages, SamplingParams(max_tokens=2))
    assert messages == before


def test_async_llm_mirrors_sync(tiny_llama, llm_tiny):
    expected = llm_tiny.generate("async hello", GREEDY)[0]

    async def run():
        async with AsyncLLM(EngineArgs(model=tiny_llama)) as llm:
            out = (await llm.generate("async hello", GREEDY))[0]
            streamed = [e async for e in llm.generate_stream("async hello", GREEDY)]
            chat = (await llm.chat([{"role": "user", "content": "hi"}],
                                   SamplingParams(max_tokens=4)))[0]
            chat_events = [e async for e in llm.chat_stream([{"role": "user", "content": "hi"}],
                                                            SamplingParams(max_tokens=4))]
            return out, streamed, chat, chat_events

    out, streamed, chat, chat_events = asyncio.run(run())
    assert out.token_ids == expected.token_ids
    assert "".join(e.text for e in streamed) == expected.text and streamed[-1].finished
    assert chat.finished and chat_events[-1].finished

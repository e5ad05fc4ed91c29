"""frequency/presence/repetition penalties and logit_bias: arithmetic, validation, engine.

Unit tests pin the exact arithmetic on hand-made logits; engine tests run the
tiny random llama (``llm_tiny``) and check what a caller sees; runner tests use
the hand scheduler for preemption and the no-penalty fast path.
"""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")

from pocketllm import InvalidRequestError, SamplingParams  # noqa: E402
from pocketllm.proto.messages import SamplingSpec  # noqa: E402
from pocketllm.protocol.openai_fields import parse_chat, parse_completion  # noqa: E402
from pocketllm.sampling import MAX_LOGIT_BIAS, check_token_ids_in_vocab  # noqa: E402
from pocketllm.workers.sampler import rules as sampler_mod, torch_ops  # noqa: E402
from pocketllm.workers.sampler.rules import TokenHistory, apply_penalties  # noqa: E402


def Sampler(seed):
    return sampler_mod.Sampler(torch_ops, seed)

ROW = [1.0, 2.0, -1.0, 0.5, 3.0]
PROMPT, OUTPUT = [0, 3], [1, 1, 2]  # token 1 generated twice, 2 once; 0 and 3 only prompted


def adjusted(spec: SamplingSpec, row=ROW, prompt=PROMPT, output=OUTPUT) -> list[float]:
    logits = torch.tensor([row])
    apply_penalties(torch_ops, logits, [spec], [TokenHistory(spec, prompt, output, len(row))])
    return logits[0].tolist()


# ------------------------------------------------------------------ exact arithmetic


def test_frequency_and_presence_count_generated_tokens_only():
    spec = SamplingSpec(frequency_penalty=0.5, presence_penalty=0.25)
    # logit -= 0.5 * count + 0.25 * (count > 0); prompt-only tokens 0 and 3 untouched
    assert adjusted(spec) == pytest.approx([1.0, 2.0 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 0.5, 3.0])
    negative = SamplingSpec(frequency_penalty=-1.0, presence_penalty=-2.0)  # encourages repeats
    assert adjusted(negative) == pytest.approx([1.0, 2.0 + 2 + 2, -1.0 + 1 + 2, 0.5, 3.0])


def test_repetition_penalty_is_the_hf_rule_over_prompt_and_output():
    spec = SamplingSpec(repetition_penalty=2.0)
    assert adjusted(spec) == pytest.approx([0.5, 1.0, -2.0, 0.25, 3.0])  # /2 if > 0 else *2
    transformers = pytest.importorskip("transformers")
    scores = torch.tensor([ROW])
    ref = transformers.RepetitionPenaltyLogitsProcessor(2.0)(
        torch.tensor([PROMPT + OUTPUT]), scores)
    assert adjusted(spec) == pytest.approx(ref[0].tolist())


def test_all_together_in_order_and_bias_last():
    spec = SamplingSpec(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                        logit_bias={4: -100.0, 2: 1.5})
    # repetition: [0.5, 1.0, -2.0, 0.25, 3.0]; then -(0.5c + 0.25) on 1 and 2; then the bias
    assert adjusted(spec) == pytest.approx([0.5, -0.25, -2.75 + 1.5, 0.25, -97.0])


def test_mixed_batch_greedy_takes_adjusted_argmax_and_logprobs_stay_raw():
    logits = torch.tensor([ROW, ROW, ROW])
    raw = logits.log_softmax(-1)
    specs = [SamplingSpec(temperature=0.0, logit_bias={4: -100.0}, logprobs=2),
             SamplingSpec(temperature=0.0, logprobs=2),
             SamplingSpec(temperature=0.0, presence_penalty=2.0)]
    histories = [TokenHistory(s, PROMPT, OUTPUT, 5) if i != 1 else None
                 for i, s in enumerate(specs)]
    out = Sampler(0)(logits, specs, [5, 5, 5], histories)
    # row 0: 4 banned -> 1 (2.0); row 1 untouched -> 4; row 2: 1 and 2 lose 2.0 -> 4 still
    assert out.token_ids == [1, 4, 4]
    assert out.logprobs[0].logprob == pytest.approx(raw[0, 1].item())  # raw, not biased
    assert out.logprobs[0].top_token_ids == [4, 1]
    assert out.logprobs[1].top_logprobs == pytest.approx(raw[1].topk(2).values.tolist())
    assert logits[1].tolist() == ROW  # a row without penalties is never written


def test_bias_bans_and_forces_when_sampling():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    for bias, allowed in (({0: -100.0}, {1, 2, 3}), ({3: 100.0}, {3})):
        drawn = set()
        for seed in range(200):
            spec = SamplingSpec(temperature=1.0, seed=seed, logit_bias=bias)
            logits = probs.log()[None].clone()
            drawn.add(Sampler(0)(logits, [spec], [3],
                                 [TokenHistory(spec, [0], [], 4)]).token_ids[0])
        assert drawn == allowed


def test_history_grows_incrementally_like_a_fresh_count():
    spec = SamplingSpec(frequency_penalty=0.1, repetition_penalty=1.3)
    grown = TokenHistory(spec, [5, 6, 5], [], 100)
    for step in ([7], [7, 5], [9]):
        grown.add_output(step)
    fresh = TokenHistory(spec, [5, 6, 5], [7, 7, 5, 9], 100)
    assert grown.output_counts() == fresh.output_counts() == {7: 2, 5: 1, 9: 1}
    assert sorted(grown.seen_ids.tolist()) == sorted(fresh.seen_ids.tolist()) == [5, 6, 7, 9]
    assert grown.prompt_len == 3
    assert TokenHistory(SamplingSpec(logit_bias={1: 2.0}), [1], [1], 10).count_ids is None


def test_worker_never_indexes_past_the_vocabulary():
    h = TokenHistory(SamplingSpec(logit_bias={3: 1.0, 99: 5.0}), [0], [], 5)
    assert h.bias_ids.tolist() == [3]


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("bad, param", [
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(presence_penalty=True), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={5: "high"}), "logit_bias"),
    (dict(logit_bias=[5]), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
])
def test_bad_values_are_typed_errors(bad, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**bad)
    assert e.value.param == param


def test_good_values_reach_the_spec():
    spec = SamplingParams(frequency_penalty=-2, presence_penalty=2, repetition_penalty=1.2,
                          logit_bias={7: -100, 8: 100}).to_spec()
    assert (spec.frequency_penalty, spec.presence_penalty, spec.repetition_penalty) == (-2, 2, 1.2)
    assert spec.logit_bias == {7: -100.0, 8: 100.0}
    assert SamplingParams().to_spec() == SamplingSpec(max_tokens=16)  # defaults: nothing to do
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as e:
        check_token_ids_in_vocab(SamplingParams(logit_bias={3: 1, 512: 1}).to_spec(), 512)
    assert e.value.param == "logit_bias"
    check_token_ids_in_vocab(spec, 512)


def test_openai_fields_parse_string_keys_and_name_the_param():
    msgs = [{"role": "user", "content": "hi"}]
    spec = parse_chat({"messages": msgs, "logit_bias": {"50": -100, "7": 2.5},
                       "frequency_penalty": 0.5, "presence_penalty": -1,
                       "repetition_penalty": 1.1}, "r").choices[0].sampling
    assert spec.logit_bias == {50: -100.0, 7: 2.5}
    assert (spec.frequency_penalty, spec.presence_penalty, spec.repetition_penalty) == (
        0.5, -1.0, 1.1)
    for body, param in [({"logit_bias": {"x1": 1}}, "logit_bias"),
                        ({"logit_bias": {"-3": 1}}, "logit_bias"),
                        ({"logit_bias": {"3": None}}, "logit_bias"),
                        ({"logit_bias": {"3": -101}}, "logit_bias"),
                        ({"presence_penalty": 3}, "presence_penalty"),
                        ({"repetition_penalty": "1"}, "repetition_penalty")]:
        with pytest.raises(InvalidRequestError) as e:
            parse_completion({"prompt": "hi", **body}, "r")
        assert e.value.param == param, body


# ------------------------------------------------------------------ through the engine

PROMPT_TEXT = "The sea is"


def greedy(llm, prompt=PROMPT_TEXT, n=24, **kw) -> list[int]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)
    return llm.generate(prompt, sp)[0].token_ids


def test_banned_token_never_appears(llm_tiny):
    plain = greedy(llm_tiny)
    banned = plain[0]
    assert plain.count(banned) > 1  # so the ban has something to remove
    out = greedy(llm_tiny, logit_bias={banned: -100})
    assert banned not in out and len(out) == 24


def test_forced_token_and_raw_logprobs(llm_tiny):
    plain = llm_tiny.generate(PROMPT_TEXT, SamplingParams(temperature=0.0, max_tokens=1,
                                                          logprobs=5))[0]
    forced_id = plain.logprobs[0].top[4].token_id  # the 5th choice, made the only one
    forced = llm_tiny.generate(PROMPT_TEXT, SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5,
        logit_bias={forced_id: 100}))[0]
    assert forced.token_ids == [forced_id] * 4
    first = forced.logprobs[0]
    assert first.logprob == pytest.approx(plain.logprobs[0].top[4].logprob, abs=1e-5)
    assert [t.token_id for t in first.top] == [t.token_id for t in plain.logprobs[0].top]


def test_presence_penalty_stops_repeats(llm_tiny):
    assert len(set(greedy(llm_tiny))) < 24  # without it, the tiny model repeats itself
    out = greedy(llm_tiny, presence_penalty=2.0)
    assert len(set(out)) == len(out) == 24


def test_frequency_penalty_lowers_the_top_count(llm_tiny):
    plain = collections.Counter(greedy(llm_tiny, n=32))
    token, count = plain.most_common(1)[0]
    assert count >= 3
    assert greedy(llm_tiny, n=32, frequency_penalty=1.0).count(token) < count


def repeats(prompt_ids: list[int], output: list[int]) -> int:
    """Generated tokens that were already in the prompt or earlier output."""
    seen, n = set(prompt_ids), 0
    for t in output:
        n += t in seen
        seen.add(t)
    return n


def test_repetition_penalty_direction(llm_tiny):
    prompt = [2, 300, 301, 302, 303, 300, 301]
    plain = repeats(prompt, greedy(llm_tiny, prompt))
    assert repeats(prompt, greedy(llm_tiny, prompt, repetition_penalty=1.5)) < plain
    assert repeats(prompt, greedy(llm_tiny, prompt, repetition_penalty=0.7)) > plain


def test_repetition_penalty_matches_transformers(llm_tiny):
    transformers = pytest.importorskip("transformers")
    if llm_tiny.capabilities.dtype != "float32":
        pytest.skip("a float32 reference needs a float32 engine")
    model = transformers.AutoModelForCausalLM.from_pretrained(llm_tiny.model_info.path,
                                                              dtype=torch.float32)
    prompt = [2, 300, 301, 302, 303, 300, 301]
    ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                         do_sample=False, repetition_penalty=1.3, max_new_tokens=16,
                         min_new_tokens=16, pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy(llm_tiny, prompt, n=16, repetition_penalty=1.3) == ref
    assert greedy(llm_tiny, prompt, n=16) != ref  # the penalty mattered


def test_penalised_request_unchanged_by_its_batch(llm_tiny):
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=1.0,
                        repetition_penalty=1.2, logit_bias={300: 3.0})
    alone = llm_tiny.generate(PROMPT_TEXT, sp)[0].token_ids
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    batch = llm_tiny.generate(["x y", PROMPT_TEXT, "z"], [plain, sp, plain])
    assert batch[1].token_ids == alone
    assert batch[0].token_ids == greedy(llm_tiny, "x y", n=16)


def test_out_of_vocabulary_bias_is_refused(llm_tiny):
    vocab = llm_tiny.model_info.vocab_size
    with pytest.raises(InvalidRequestError) as e:
        greedy(llm_tiny, n=2, logit_bias={vocab: -100})
    assert e.value.param == "logit_bias"


# ------------------------------------------------------------------ the runner


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from pocketllm.config import EngineArgs
    from pocketllm.model_info import load_model_info
    from pocketllm.workers.runner import ModelRunner
    from tiny_checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))
    args = EngineArgs(model=path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                      seed=3)
    return ModelRunner(load_model_info(args), args)


def drive(runner, spec: SamplingSpec, preempt_at=None) -> list[int]:
    from tiny_checkpoints import PlanDriver

    driver = PlanDriver(runner, shuffle_blocks=1)
    driver.add("r", [2, 300, 301, 302, 303], spec, 20)
    if preempt_at is not None:
        for _ in range(preempt_at):
            driver.step_once()
        driver.preempt("r")
    return driver.run()["r"]


def test_preempted_request_keeps_its_output_counts(runner):
    spec = SamplingSpec(temperature=0.0, frequency_penalty=2.0)
    whole = drive(runner, spec)
    assert whole != drive(runner, SamplingSpec(temperature=0.0))
    assert drive(runner, spec, preempt_at=8) == whole


def test_requests_without_penalties_cost_nothing(runner, monkeypatch):
    def fail(*_args, **_kw):
        raise AssertionError("penalty work for a request that uses none")

    monkeypatch.setattr(sampler_mod, "apply_penalties", fail)
    monkeypatch.setattr(sampler_mod.TokenHistory, "__init__", fail)
    drive(runner, SamplingSpec(temperature=0.7, top_k=5, seed=1), preempt_at=3)
    assert all(state.history is None for state in runner.book.requests.values())


def test_a_draft_rows_history_counts_the_drafts_before_it_and_leaves_the_request_alone():
    spec = SamplingSpec(frequency_penalty=0.5, repetition_penalty=1.3)
    history = sampler_mod.TokenHistory(spec, [1, 2], [3, 3], 16)
    row = history.extended([3, 4, 9])
    assert row.output_counts() == {3: 3, 4: 1, 9: 1}
    assert sorted(row.seen_ids.tolist()) == [1, 2, 3, 4, 9]
    assert history.output_counts() == {3: 2} and sorted(history.seen_ids.tolist()) == [1, 2, 3]
    assert history.extended([]) is history

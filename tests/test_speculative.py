"""Speculative decoding (docs/speculative.md): the n-gram drafter; the scheduler's
multi-token steps against the fake worker (whose KV checks catch a rejected draft's
position read as real), several requests at once, stops, prefix caching and preemption;
whole engines on the embedded model, a request alone (whose steps never share rows with
another's prompt, the one case where a CPU step's rows are computed differently):
the same text with speculation as without, greedy and seeded, with a stop string,
logprobs and a cached prefix; and the refusals."""

from __future__ import annotations

import re

import pytest

from pocketllm.config import EngineArgs
from pocketllm.errors import InvalidRequestError
from pocketllm.scheduler.drafter import COOLDOWN, MAX_START_PAUSE, Drafter
from pocketllm.scheduler.ngram import NgramDrafter
from speculation_checks import same
from test_scheduler_harness import Driver, config, make_request, next_token

# --- the n-gram drafter -------------------------------------------------------------------


def test_the_tokens_after_the_latest_match_of_the_longest_suffix():
    d = NgramDrafter(4)
    assert d.propose("a", [1, 2, 3, 4, 5, 6, 7, 1, 2, 3], 10) == [4, 5, 6, 7]
    assert d.propose("a", [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5], 10) == [6, 7, 1, 2]
    assert d.propose("a", [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5], 2) == [6, 7]  # the room
    assert d.propose("b", [5, 6, 7, 8], 4) == []  # nothing repeats
    # the longest suffix wins: (9, 2) occurred later than (1, 2) but (8, 1, 2) matches more
    assert d.propose("c", [8, 1, 2, 3, 9, 2, 4, 8, 1, 2], 4) == [3, 9, 2, 4]


def test_drafts_shorten_as_they_fail_and_pause_when_none_is_accepted():
    d = NgramDrafter(4)
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert d.propose("a", tokens, 10) == [3, 4, 5, 1]
    d.verified("a", 4, 1)  # average 0.625: 4 * 0.625 = 2.5 -> 2
    assert d.propose("a", tokens, 10) == [3, 4]
    d.verified("a", 2, 0)  # none accepted: a pause
    assert all(d.propose("a", tokens, 10) == [] for _ in range(COOLDOWN))
    assert d.propose("a", tokens, 10) == [3]  # then a probe of one draft
    d.verified("a", 1, 0)  # failing again: a pause twice as long
    assert all(d.propose("a", tokens, 10) == [] for _ in range(2 * COOLDOWN))
    assert d.propose("a", tokens, 10) == [3]
    d.verified("a", 1, 1)  # an accepted probe: the length grows back, step by step
    assert d.propose("a", tokens, 10) == [3, 4]
    d.verified("a", 2, 2)
    assert d.propose("a", tokens, 10) == [3, 4, 5]
    d.verified("a", 3, 3)
    assert d.propose("a", tokens, 10) == [3, 4, 5, 1]
    d.verified("a", 4, 0)  # the next pause is short again
    assert all(d.propose("a", tokens, 10) == [] for _ in range(COOLDOWN))
    assert d.propose("a", tokens, 10) == [3]
    d.forget("a")


def test_a_new_request_starts_from_the_drafters_recent_acceptance():
    """While drafts fail for everyone, a new request starts paused for as long as the latest
    failure paused (at most ``MAX_START_PAUSE`` steps) and then probes with one draft (not
    k on its first steps); once drafts are accepted again, a new one starts at once, at
    the length the recent acceptance gives."""
    d = NgramDrafter(4)
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert not d.paused("a") and d.length("a") == 4  # nothing verified yet: k
    assert d.propose("a", tokens, 10) == [3, 4, 5, 1]
    for rid in "awxy":  # 0.75 ** 8 = 0.1: under half a draft of 4; each paused 4, then 8
        d.paused(rid)
        for _ in range(2):
            d.verified(rid, 1, 0)
    assert d.paused("b")
    assert sum(d.propose("b", tokens, 10) == [] for _ in range(40)) == 8
    assert d.propose("b", tokens, 10) == [3]
    for _ in range(3):  # paused up to 64: a new request waits at most MAX_START_PAUSE
        d.verified("y", 1, 0)
    assert sum(d.propose("c", tokens, 100) == [] for _ in range(100)) == MAX_START_PAUSE
    for _ in range(3):  # accepted again: 1 - 0.9 * 0.75 ** 3 = 0.62
        d.verified("c", 1, 1)
    assert not d.paused("e") and d.propose("e", tokens, 10) == [3, 4]



class WrongDrafter(Drafter):
    """Proposes the fake model's continuation, each token moved by one: none accepted."""

    def candidates(self, request_id, tokens, want):
        out, ctx = [], list(tokens)
        for _ in range(want):
            out.append((next_token(ctx) + 1) % 1000)
            ctx.append(next_token(ctx))
        return out


def test_paused_requests_are_planned_ahead_and_their_pause_still_runs_out():
    """With overlap on, a step whose every request has paused drafting is planned before the
    last one's result (no wait for tokens it would not draft from); those steps spend the
    pause as asked ones do, so drafting resumes on the same steps as without overlap."""
    def drafting_steps(driver):
        return [i for i, p in enumerate(driver.plans) if p.draft_token_ids]

    want, _ = run([make_request("a", [5, 6, 7, 8, 9], max_tokens=60)])
    plain = Driver(config(num_speculative_tokens=4))
    plain.sched.drafter = WrongDrafter(4)
    plain.add(make_request("a", [5, 6, 7, 8, 9], max_tokens=60))
    plain.run()
    over = Driver(config(num_speculative_tokens=4, overlap=True))
    over.sched.drafter = WrongDrafter(4)
    over.add(make_request("a", [5, 6, 7, 8, 9], max_tokens=60))
    got = over.run_overlapped()
    assert got["a"].tokens == want["a"].tokens == plain.outcomes["a"].tokens
    assert over.sched.num_overlapped_steps > 20  # the paused steps
    assert drafting_steps(over) == drafting_steps(plain)
    assert len(drafting_steps(plain)) == 4  # 0, then after pauses of 4, 8 and 16 steps

# --- the scheduler's speculative steps, against the fake worker ----------------------------

class Oracle:
    """Drafts the fake model's own continuation: ``right`` tokens of it, then wrong ones."""

    in_worker = False

    def __init__(self, k: int, right: int):
        self.k, self.right = k, right
        self.verified_calls: list[tuple[int, int]] = []

    def propose(self, rid: str, tokens: list[int], limit: int) -> list[int]:
        out, ctx = [], list(tokens)
        for j in range(min(self.k, limit)):
            t = next_token(ctx)
            out.append(t if j < self.right else (t + 1) % 1000)
            ctx.append(t)
        return out

    def verified(self, rid: str, drafted: int, accepted: int) -> None:
        self.verified_calls.append((drafted, accepted))

    def paused(self, rid: str) -> bool:
        return False

    def forget(self, rid: str) -> None:
        pass


def run(requests, drafter=None, **cfg):
    driver = Driver(config(num_speculative_tokens=4 if drafter else 0, **cfg))
    if drafter:
        driver.sched.drafter = drafter
    for r in requests:
        driver.add(r)
    return driver.run(), driver


def requests(**kw):
    return [make_request("a", [5, 6, 7, 8, 9], max_tokens=23, **kw),
            make_request("b", list(range(30, 47)), max_tokens=9, **kw)]


@pytest.mark.parametrize("right", [4, 2, 0])  # all accepted, some, none
def test_speculative_steps_produce_the_tokens_decoding_does(right):
    want, plain = run(requests())
    oracle = Oracle(4, right)
    got, spec = run(requests(), oracle)
    assert {k: (o.tokens, o.finish_reason) for k, o in got.items()} == \
        {k: (o.tokens, o.finish_reason) for k, o in want.items()}
    assert all(a == min(d, right) for d, a in oracle.verified_calls)
    assert any(p.draft_token_ids for p in spec.plans)
    if right == 4:  # up to five tokens a step: fewer steps
        assert len(spec.plans) < len(plain.plans) / 2
    stats = spec.sched.stats()
    assert stats["spec_draft_tokens"] == sum(d for d, _ in oracle.verified_calls)
    assert stats["spec_accepted_tokens"] == sum(a for _, a in oracle.verified_calls)


def test_a_stop_token_or_eos_among_the_accepted_ends_the_request_there():
    plain = run([make_request("a", [5, 6, 7, 8, 9], max_tokens=30)])[0]["a"].tokens
    eos, stop = plain[6], plain[11]
    for kw in (dict(eos=(eos,)), dict(stop_token_ids=[stop])):
        want = run([make_request("a", [5, 6, 7, 8, 9], max_tokens=30, **kw)])[0]["a"]
        got = run([make_request("a", [5, 6, 7, 8, 9], max_tokens=30, **kw)], Oracle(4, 4))[0]["a"]
        assert (got.tokens, got.finish_reason, got.hidden) == \
            (want.tokens, want.finish_reason, want.hidden) == (want.tokens, "stop", 1)


def test_drafts_never_pass_max_tokens_max_model_len_or_the_budget():
    outcomes, driver = run([make_request("a", [1, 2, 3], max_tokens=6),
                            make_request("b", list(range(50, 60)), max_tokens=40)],
                           Oracle(4, 4), max_model_len=30, max_num_batched_tokens=8)
    assert len(outcomes["a"].tokens) == 6 and outcomes["a"].finish_reason == "length"
    assert len(outcomes["b"].tokens) == 30 - 10 and outcomes["b"].finish_reason == "length"
    for plan in driver.plans:
        assert sum(plan.num_scheduled_tokens) <= 8


def test_prefix_caching_and_preemption_with_rejected_drafts():
    """Half-rejected drafts under a KV cache too small for all (preemption) and a shared
    prefix (the cache): the fake worker reads back every position it attends to, so a
    rejected draft's position published or read as real fails."""
    prompt = list(range(100, 121))
    reqs = lambda: [make_request(f"r{i}", prompt + [i], max_tokens=30) for i in range(4)]  # noqa
    want = run(reqs(), num_kv_blocks=24)[0]
    got, driver = run(reqs(), Oracle(4, 2), num_kv_blocks=24)
    assert {k: o.tokens for k, o in got.items()} == {k: o.tokens for k, o in want.items()}
    assert driver.sched.stats()["preemptions"] > 0
    assert driver.sched.stats()["prefix_cache_hits"] > 0


def test_requests_with_penalties_or_bias_draft_too():
    """The worker counts a run's earlier drafts in each row's penalties (exact per
    position), so such requests draft like any other."""
    _, driver = run([make_request("p", [1, 2, 3, 1, 2], max_tokens=5, presence_penalty=0.5),
                     make_request("b", [1, 2, 3, 1, 2], max_tokens=5, logit_bias={3: 1.0})],
                    Oracle(4, 4))
    drafting = {rid for p in driver.plans for rid, d in zip(
        [r.request_id for r in p.new_requests] + [r.request_id for r in p.cached_requests],
        p.draft_token_ids) if d}
    assert drafting == {"p", "b"}


def test_no_drafts_above_the_batch_limit():
    many = [make_request(f"r{i}", [i, i + 1, i + 2], max_tokens=5) for i in range(6)]
    _, driver = run(many, Oracle(4, 4), speculative_max_batch=4)
    decodes_of = lambda p: sum(n == 1 or bool(d) for n, d in zip(  # noqa: E731
        p.num_scheduled_tokens, p.draft_token_ids or [[]] * len(p.num_scheduled_tokens)))
    for plan in driver.plans:
        if plan.draft_token_ids:
            assert decodes_of(plan) <= 4


# --- the engine, on the embedded model ------------------------------------------------------

TEXT = ("The quick brown fox jumps over the lazy dog. A paged KV cache holds each sequence's "
        "keys and values in blocks; a block table maps positions to blocks, so sequences of "
        "any length share one pool without copying.")
COPY = f"Repeat this text exactly.\n\nText: {TEXT}\n\nRepeated: {TEXT[:40]}"


@pytest.fixture(scope="module")
def engines(default_model_path):
    from pocketllm import LLM

    plain = LLM(max_model_len=1024)
    spec = LLM(max_model_len=1024, speculative_method="ngram", num_speculative_tokens=4)
    yield plain, spec
    for llm in (plain, spec):
        llm.shutdown()


def test_engine_greedy_and_seeded_text_is_the_same_with_speculation(engines):
    from pocketllm import SamplingParams

    plain, spec = engines
    for sp in (SamplingParams(max_tokens=48, temperature=0),
               SamplingParams(max_tokens=48, temperature=0.9, top_p=0.95, seed=11),
               SamplingParams(max_tokens=7, temperature=0)):  # max_tokens lands mid-run
        same(plain.generate([COPY], sp), spec.generate([COPY], sp))


def test_engine_sampled_text_is_the_same_for_every_seed(engines):
    """The sampled distribution unchanged, seed by seed: at temperature 1 (many drafts
    rejected) each of 8 seeds, on two prompts, gives the same tokens with speculation as
    without."""
    from pocketllm import SamplingParams

    plain, spec = engines
    prompts = [COPY, "Write a short story about a lighthouse keeper."]
    for seed in range(8):
        sp = SamplingParams(max_tokens=16, temperature=1.0, seed=seed)
        for prompt in prompts:
            same(plain.generate([prompt], sp), spec.generate([prompt], sp))


def test_engine_stop_strings_logprobs_and_a_cached_prefix(engines):
    from pocketllm import SamplingParams

    plain, spec = engines
    first = plain.generate([COPY], SamplingParams(max_tokens=40, temperature=0))[0]
    stop = first.text.split()[4]  # a word well inside the answer
    sp = SamplingParams(max_tokens=40, temperature=0, stop=[stop], logprobs=2)
    want, got = plain.generate([COPY], sp), spec.generate([COPY], sp)
    same(want, got)
    assert got[0].finish_reason == "stop" and stop not in got[0].text
    for a, b in zip(want[0].logprobs, got[0].logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-3)
    again = spec.generate([COPY], SamplingParams(max_tokens=40, temperature=0))  # cached
    assert again[0].usage.cached_tokens > 0
    same(again, [first])


COPY_JSON = ('Repeat this JSON object exactly.\n\n{"keeper": "Ada", "years": 100, "light": '
             '"on", "ships": ["Lumen", "Petrel"]}\n\nRepeated: ')
JSON_CHAT = [{"role": "user", "content": 'Repeat this JSON object exactly: {"keeper": "Ada", '
              '"years": 100, "light": "on", "ships": ["Lumen", "Petrel"]}'}]


def test_engine_penalties_bias_and_grammars_apply_per_position(engines):
    """Each draft's row gets the penalties counting the drafts before it, logit_bias, and
    the grammar's mask after them: the text is the text without speculation, and drafts
    were verified for each kind of request."""
    from pocketllm import SamplingParams
    from pocketllm.bench.throughput import settled_stats

    plain, spec = engines
    for sp in (SamplingParams(max_tokens=40, temperature=0, frequency_penalty=0.4,
                              presence_penalty=0.2),
               SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.15),
               SamplingParams(max_tokens=40, temperature=0.8, seed=5,
                              logit_bias={236764: 3.0, 107: -5.0}),
               SamplingParams(max_tokens=60, temperature=0,
                              response_format={"type": "json_object"})):
        before = settled_stats(spec)
        if sp.response_format:
            same(plain.chat(JSON_CHAT, sp), spec.chat(JSON_CHAT, sp))
        else:
            same(plain.generate([COPY_JSON], sp), spec.generate([COPY_JSON], sp))
        assert settled_stats(spec, newer_than=before).spec_draft_tokens > before.spec_draft_tokens


def test_engine_counts_drafts_and_accepts_most_on_a_copy(engines):
    import time

    from pocketllm import SamplingParams

    _, spec = engines
    before = spec.engine_stats()
    spec.generate([COPY], SamplingParams(max_tokens=48, temperature=0))
    deadline = time.monotonic() + 5  # the scheduler sends its figures when it goes idle
    while spec.engine_stats().spec_draft_tokens == before.spec_draft_tokens:
        assert time.monotonic() < deadline, "no drafts counted"
        time.sleep(0.05)
    after = spec.engine_stats()
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert drafted > 0 and accepted > drafted / 2
    assert spec.engine_caps().num_speculative_tokens == 4


# --- refusals ------------------------------------------------------------------------------

def test_engine_args_refusals():
    with pytest.raises(InvalidRequestError, match="speculative_method"):
        EngineArgs(speculative_method="eagle")
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        EngineArgs(speculative_method="ngram", num_speculative_tokens=99)
    with pytest.raises(InvalidRequestError, match="speculative_replay"):
        EngineArgs(speculative_method="replay")
    with pytest.raises(InvalidRequestError, match="speculative_replay"):
        EngineArgs(speculative_replay="runs.json")
    with pytest.raises(InvalidRequestError, match="speculative_replay"):
        EngineArgs(speculative_method="ngram", speculative_replay="runs.json")


def test_a_draft_count_without_a_method_is_refused():
    """``num_speculative_tokens`` changes nothing where nothing drafts, so it is refused
    there, from the library and from the command line, not ignored; with a method it
    defaults to 4."""
    from pocketllm.cli import build_parser, engine_args_from

    assert EngineArgs(speculative_method="ngram").num_speculative_tokens == 4
    assert EngineArgs().num_speculative_tokens is None
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens without"):
        EngineArgs(num_speculative_tokens=2)
    parse = build_parser().parse_args
    assert engine_args_from(parse(["serve", "--speculative-method", "ngram",
                                   "--num-speculative-tokens", "2"])).num_speculative_tokens == 2
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens without"):
        engine_args_from(parse(["serve", "--num-speculative-tokens", "2"]))


def test_server_n_choices_and_metrics_with_speculation(default_model_path):
    """n > 1 over HTTP: each greedy choice is the same with n-gram speculation as without,
    and /metrics counts the drafts. (Seeded sampling is compared on one request above: the
    choices of one request run side by side, and a decode that shares a step with another
    choice's prompt chunk is computed by the many-row product, with or without
    speculation, depending on arrival times: docs/speculative.md.)"""
    import httpx

    from server_process import ServerProcess

    body = {"prompt": COPY, "max_tokens": 32, "n": 3, "temperature": 0}
    texts = []
    for extra in ((), ("--speculative-method", "ngram")):
        srv = ServerProcess("--max-model-len", "1024", *extra)
        try:
            got = [httpx.post(srv.url + "/v1/completions", json=b, timeout=120).json()
                   for b in (body, {**body, "max_tokens": 9, "n": 2})]
            texts.append([[c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
                          for r in got])
            drafted = _metric(srv, "pocketllm_spec_draft_tokens_total")
        finally:
            assert srv.stop() == 0
    assert texts[0] == texts[1] and len(texts[0][0]) == 3
    assert drafted > 0


def _metric(srv, name: str) -> float:
    """A counter of /metrics once the scheduler's idle report has reached it (5 s at most)."""
    import time

    import httpx

    deadline = time.monotonic() + 5
    while True:
        found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$",
                          httpx.get(srv.url + "/metrics").text, re.M)
        value = float(found.group(1)) if found else 0.0
        if value > 0 or time.monotonic() > deadline:
            return value
        time.sleep(0.1)

"""Sampling: greedy, temperature/top-k/top-p/min-p, per-request seeds, raw-logit logprobs."""

from __future__ import annotations

import collections
import math
import random

import pytest

torch = pytest.importorskip("torch")

from pocketllm.config import EngineArgs  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.proto.messages import SamplingSpec  # noqa: E402
from pocketllm.workers.layers.sampler import Sampler, seeded_uniform  # noqa: E402
from pocketllm.workers.runner import ModelRunner  # noqa: E402
from tiny_checkpoints import PlanDriver, make_tiny_checkpoint  # noqa: E402

PROBS = torch.tensor([0.5, 0.3, 0.12, 0.08])
LOGITS = PROBS.log()[None]


def draws(spec: SamplingSpec, n: int = 400) -> collections.Counter:
    """n draws with seeds 0..n-1 (each seed is an independent stream)."""
    sampler = Sampler(0)
    counts = collections.Counter()
    for seed in range(n):
        spec_i = SamplingSpec(**{**_fields(spec), "seed": seed})
        counts[sampler(LOGITS, [spec_i], [5]).token_ids[0]] += 1
    return counts


def _fields(spec: SamplingSpec) -> dict:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


def test_plain_sampling_follows_the_distribution():
    counts = draws(SamplingSpec(temperature=1.0), n=2000)
    for token, p in enumerate(PROBS.tolist()):
        assert abs(counts[token] / 2000 - p) < 0.04


def test_top_k_top_p_min_p_restrict_the_support():
    assert set(draws(SamplingSpec(temperature=1.0))) == {0, 1, 2, 3}
    assert set(draws(SamplingSpec(temperature=1.0, top_k=2))) == {0, 1}
    assert set(draws(SamplingSpec(temperature=1.0, top_p=0.75))) == {0, 1}  # 0.5 + 0.3 covers it
    assert set(draws(SamplingSpec(temperature=1.0, top_p=0.85))) == {0, 1, 2}
    assert set(draws(SamplingSpec(temperature=1.0, min_p=0.5))) == {0, 1}  # p >= 0.25
    assert set(draws(SamplingSpec(temperature=1.0, top_k=3, top_p=0.75))) == {0, 1}
    assert set(draws(SamplingSpec(temperature=1.0, top_p=0.01))) == {0}
    counts = draws(SamplingSpec(temperature=1.0, top_k=2), n=1000)
    assert abs(counts[0] / 1000 - 0.5 / 0.8) < 0.05  # renormalized over the kept tokens


def test_temperature_sharpens_and_greedy_rows():
    cold = draws(SamplingSpec(temperature=0.2))
    assert cold[0] > 0.9 * sum(cold.values())
    assert set(draws(SamplingSpec(temperature=0.0), n=50)) == {0}
    assert set(draws(SamplingSpec(temperature=1.5, top_k=1), n=50)) == {0}


def test_logprobs_come_from_raw_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    specs = [SamplingSpec(temperature=t, top_k=k, top_p=p, seed=1, logprobs=4)
             for t, k, p in ((0.0, 0, 1.0), (0.3, 5, 0.9), (2.0, 0, 0.5))]
    out = Sampler(0)(logits, specs, [9, 9, 9])
    raw = logits.log_softmax(-1)
    for row, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.logprob == pytest.approx(raw[row, token].item(), abs=1e-6)
        assert lp.top_token_ids == raw[row].topk(4).indices.tolist()
        assert lp.top_logprobs == pytest.approx(raw[row].topk(4).values.tolist(), abs=1e-6)
    none_asked = Sampler(0)(logits[:1], [SamplingSpec(temperature=0.0, logprobs=0)], [1])
    assert none_asked.logprobs[0].top_token_ids == []
    assert Sampler(0)(logits[:1], [SamplingSpec()], [1]).logprobs == [None]


def test_seeded_uniform_is_a_pure_function():
    assert seeded_uniform(7, 3) == seeded_uniform(7, 3)
    values = {seeded_uniform(7, p) for p in range(1000)} | {seeded_uniform(s, 3) for s in range(1000)}
    assert len(values) > 1990 and all(0 <= u < 1 for u in values)
    assert abs(sum(seeded_uniform(11, p) for p in range(4000)) / 4000 - 0.5) < 0.02


def test_unseeded_rows_share_a_reproducible_stream():
    logits = torch.zeros(4, 1000)
    specs = [SamplingSpec(temperature=1.0)] * 4
    a = [Sampler(5)(logits, specs, [0] * 4).token_ids for _ in range(3)]
    sampler = Sampler(5)
    b = [sampler(logits, specs, [0] * 4).token_ids for _ in range(3)]
    assert a[0] == b[0] and b[0] != b[1]


# ------------------------------------------------------------------ through the runner


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = make_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))
    args = EngineArgs(model=path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                      seed=3)
    return ModelRunner(load_model_info(args), args)


PROMPTS = {name: [random.Random(i).randrange(3, 512) for _ in range(9 + 3 * i)]
           for i, name in enumerate(["x", "seeded", "y"])}
SEEDED = SamplingSpec(temperature=1.3, top_p=0.95, seed=1234)
NOISE = SamplingSpec(temperature=1.0)


def run(runner, specs: dict, new_tokens: int = 16, preempt_at=None, logprobs=False):
    driver = PlanDriver(runner, shuffle_blocks=1)
    for rid, spec in specs.items():
        driver.add(rid, PROMPTS[rid], spec, new_tokens)
    if preempt_at is not None:
        for _ in range(preempt_at):
            driver.step_once()
        driver.preempt("seeded")
    tokens = driver.run()
    return (tokens, driver) if logprobs else tokens


def test_seeded_request_is_independent_of_the_batch(runner):
    alone = run(runner, {"seeded": SEEDED})["seeded"]
    batched = run(runner, {"x": NOISE, "seeded": SEEDED, "y": NOISE})["seeded"]
    assert batched == alone
    assert run(runner, {"seeded": SEEDED}, preempt_at=6)["seeded"] == alone
    other_seed = SamplingSpec(temperature=1.3, top_p=0.95, seed=99)
    assert run(runner, {"seeded": other_seed})["seeded"] != alone


def test_top_k_one_is_greedy(runner):
    greedy = run(runner, {"x": SamplingSpec(temperature=0.0)})["x"]
    assert run(runner, {"x": SamplingSpec(temperature=1.0, top_k=1)})["x"] == greedy
    assert run(runner, {"x": SamplingSpec(temperature=0.7, top_k=1, seed=4)})["x"] == greedy


def test_runner_logprobs_ignore_temperature(runner):
    _, cold = run(runner, {"x": SamplingSpec(temperature=0.0, logprobs=3)}, 1, logprobs=True)
    _, hot = run(runner, {"x": SamplingSpec(temperature=5.0, seed=1, logprobs=3)}, 1, logprobs=True)
    a, b = cold.reqs["x"].logprobs[0], hot.reqs["x"].logprobs[0]
    assert a.top_token_ids == b.top_token_ids
    assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-6)
    assert math.isfinite(b.logprob) and b.logprob <= 0


def test_top_p_probe_gives_what_the_full_sort_gives(monkeypatch):
    """The top-p shortcut (cut inside the best NUCLEUS_PROBE tokens) must be exact."""
    from pocketllm.proto.messages import SamplingSpec
    from pocketllm.workers.layers import sampler as smp

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5000, generator=gen) * 4  # peaky enough to fit in the probe
    specs = [SamplingSpec(temperature=0.8, top_p=p) for p in (0.5, 0.9, 0.95)]
    uniforms = torch.rand(200, 3, generator=gen)
    monkeypatch.setattr(smp, "NUCLEUS_PROBE", 256)
    assert smp._nucleus_lse(logits / 0.8, [0.5, 0.9, 0.95], 256) is not None  # path taken
    fast = [smp._draw(logits, specs, u) for u in uniforms]
    monkeypatch.setattr(smp, "NUCLEUS_PROBE", 10**9)  # always the full sort
    full = [smp._draw(logits, specs, u) for u in uniforms]
    assert all(torch.equal(a, b) for a, b in zip(fast, full))

"""The torch-free worker's numpy sampler (workers/lite/sampler.py) against the torch
sampler it ports (workers/layers/sampler.py).

Greedy and seeded rows must get the same tokens, penalties and grammar masks must leave
the same logits to the bit, and logprobs must agree to 1e-5 with the same ids. The one
licence (the lite module's docstring says why): a draw whose uniform lands within float32
rounding of the edge between two tokens, since torch and numpy add a softmax up in
different orders. ``assert_same_draws`` lets such a draw differ, rarely, and checks that
it is one: nudging its uniform by 1e-5 of itself must give numpy torch's token.
"""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from pocketllm.proto.messages import SamplingSpec
from pocketllm.sampling import is_greedy
from pocketllm.workers.lite import sampler as lite

torch = pytest.importorskip("torch")
from pocketllm.workers.layers import sampler as ref  # noqa: E402

V = 4096
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rand_logits(rows: int, vocab: int = V, scale: float = 3.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)


def seeded(spec: SamplingSpec, seed: int) -> SamplingSpec:
    return msgspec.structs.replace(spec, seed=seed)


def assert_same_draws(expected, got, redraw) -> None:
    """Equal tokens, bar a rare near tie. ``redraw(i, factor)``: numpy's token for draw i
    with its uniform times ``factor``."""
    expected, got = np.asarray(expected), np.asarray(got)
    differ = np.flatnonzero(expected != got)
    assert len(differ) <= max(1, len(expected) // 500), f"{len(differ)}/{len(expected)} differ"
    for i in differ:
        assert expected[i] in {redraw(i, 1 - 1e-5), redraw(i, 1 + 1e-5)}, (
            f"draw {i}: torch {expected[i]}, numpy {got[i]}, and no near tie")


def compare_draws(logits: np.ndarray, specs: list[SamplingSpec], n: int = 100,
                  probe: bool = True) -> np.ndarray:
    """``n`` uniforms per row through both ``_draw``s at once: the rows repeated ``n``
    times, which leaves the group's shared choices (sort, width, probe) as for one copy."""
    rows = len(specs)
    u = np.random.default_rng(1).random(n * rows).astype(np.float32)
    tiled, tiled_specs = np.tile(logits, (n, 1)), list(specs) * n
    expected = ref._draw(torch.from_numpy(tiled), tiled_specs, torch.from_numpy(u),
                         probe=probe).numpy()
    got = lite._draw(tiled, tiled_specs, u, probe=probe)

    def redraw(i: int, factor: float) -> int:
        copy, row = divmod(i, rows)
        nudged = u[copy * rows:(copy + 1) * rows].copy()
        nudged[row] *= np.float32(factor)
        return lite._draw(logits, specs, nudged, probe=probe)[row]

    assert_same_draws(expected, got, redraw)
    return got.reshape(n, rows)


def run_both(logits: np.ndarray, specs: list[SamplingSpec], positions=None, history=None,
             mask=None, batch_invariant: bool = False):
    """Both Samplers on copies of ``logits``; checks tokens of greedy and seeded rows,
    logprobs, and the logits each left behind (penalties and masks act in place).
    ``history``: per row (prompt, output) or None; ``mask``: (structured ids, bitmask
    bytes, sampled ids) as a plan carries them."""
    positions = positions or [7] * len(specs)
    vocab = logits.shape[-1]
    t_logits, n_logits = torch.from_numpy(logits.copy()), logits.copy()
    t_hist = n_hist = t_mask = n_mask = None
    if history is not None:
        t_hist = [ref.TokenHistory(s, *h, vocab) if h else None for s, h in zip(specs, history)]
        n_hist = [lite.TokenHistory(s, *h, vocab) if h else None for s, h in zip(specs, history)]
    if mask is not None:
        t_mask, n_mask = ref.structured_token_mask(*mask), lite.structured_token_mask(*mask)
    expected = ref.Sampler(0, batch_invariant)(t_logits, specs, positions, t_hist, t_mask)
    got = lite.Sampler(0, batch_invariant).sample(n_logits, specs, positions, n_hist, n_mask)

    np.testing.assert_array_equal(n_logits, t_logits.numpy())
    assert all(type(t) is int for t in got.token_ids)
    compared = [i for i, s in enumerate(specs) if is_greedy(s) or s.seed is not None]
    random_rows = [i for i, s in enumerate(specs) if not is_greedy(s)]
    uniforms = lite.Sampler(0)._uniforms([specs[i] for i in random_rows],
                                         [positions[i] for i in random_rows])

    def redraw(j: int, factor: float) -> int:
        i = compared[j]
        if i not in random_rows:
            return got.token_ids[i]  # a greedy row has no uniform to blame
        nudged = uniforms.copy()
        nudged[random_rows.index(i)] *= np.float32(factor)
        for group, at in lite._draw_groups(random_rows, specs, vocab, batch_invariant):
            if i in group:
                return lite._draw(n_logits[group], [specs[g] for g in group], nudged[at],
                                  probe=not batch_invariant)[group.index(i)]

    assert_same_draws([expected.token_ids[i] for i in compared],
                      [got.token_ids[i] for i in compared], redraw)
    for a, b in zip(expected.logprobs, got.logprobs):
        if a is None:
            assert b is None
            continue
        assert b.top_token_ids == a.top_token_ids
        assert b.logprob == pytest.approx(a.logprob, abs=1e-5)
        assert b.top_logprobs == pytest.approx(a.top_logprobs, abs=1e-5)
    return expected, got


# ------------------------------------------------------------------ draws, rule by rule


def test_greedy_rows_take_the_first_maximum():
    logits = rand_logits(6)
    logits[2, [10, 20]] = 50.0  # a tie: the first one wins, in both
    specs = [SamplingSpec(temperature=0.0), SamplingSpec(temperature=1.3, top_k=1)] * 3
    expected, got = run_both(logits, specs)
    assert got.token_ids == expected.token_ids == logits.argmax(-1).tolist()
    assert got.token_ids[2] == 10


@pytest.mark.parametrize("kind, specs", [
    ("temperature", [SamplingSpec(temperature=t) for t in (1.0, 0.7, 1.6)]),
    ("top_k", [SamplingSpec(temperature=1.0, top_k=k) for k in (2, 40, 1000)]),
    ("min_p", [SamplingSpec(temperature=1.0, min_p=m) for m in (0.02, 0.2, 0.6)]),
    ("top_k+top_p", [SamplingSpec(temperature=0.9, top_k=k, top_p=p)
                     for k, p in ((50, 0.8), (400, 0.95), (5, 0.3))]),
    ("all", [SamplingSpec(temperature=0.8, top_k=100, top_p=0.9, min_p=0.05),
             SamplingSpec(temperature=1.2, top_p=0.7, min_p=0.1),
             SamplingSpec(temperature=1.0, top_k=30, min_p=0.01)]),
    ("mixed group", [SamplingSpec(temperature=1.0), SamplingSpec(temperature=0.7, top_p=0.9),
                     SamplingSpec(temperature=1.1, top_k=20), SamplingSpec(min_p=0.1)]),
])
def test_draws_match_torch(kind, specs):
    got = compare_draws(rand_logits(len(specs), seed=sum(map(ord, kind))), specs)
    assert len(np.unique(got)) > 2 * len(specs)  # the rows really drew at random


def test_top_p_probe_and_full_sort_paths_match_torch():
    top_ps = [0.5, 0.9, 0.95]
    specs = [SamplingSpec(temperature=1.0, top_p=p) for p in top_ps]
    peaky, flat = rand_logits(3, scale=3.0, seed=4), rand_logits(3, scale=1.0, seed=5)
    # Which path each takes, in both samplers (temperature 1: x is the logits).
    for x, probed in ((peaky, True), (flat, False)):
        assert (lite._nucleus(x, top_ps, lite.NUCLEUS_PROBE)[0] is not None) is probed
        assert (ref._nucleus_lse(torch.from_numpy(x), top_ps, ref.NUCLEUS_PROBE)
                is not None) is probed
    compare_draws(peaky, specs)
    compare_draws(flat, specs)
    compare_draws(peaky, specs, probe=False)  # the batch-invariant mode never probes


def test_top_p_probe_over_a_262k_vocabulary(monkeypatch):
    """The probe must take the same token as torch and as numpy's own full sort."""
    logits = rand_logits(3, vocab=262_144, scale=4.0, seed=7)  # peaky enough for the probe
    specs = [SamplingSpec(temperature=0.8, top_p=p) for p in (0.5, 0.9, 0.95)]
    x = logits / np.float32(0.8)
    assert lite._nucleus(x, [0.5, 0.9, 0.95], lite.NUCLEUS_PROBE)[0] is not None
    assert ref._nucleus_lse(torch.from_numpy(x), [0.5, 0.9, 0.95], ref.NUCLEUS_PROBE) is not None
    uniforms = np.random.default_rng(2).random((8, 3)).astype(np.float32)
    expected = [ref._draw(torch.from_numpy(logits), specs, torch.from_numpy(u)).tolist()
                for u in uniforms]
    probed = [lite._draw(logits, specs, u).tolist() for u in uniforms]
    monkeypatch.setattr(lite, "NUCLEUS_PROBE", 10**9)  # always the full sort
    full = [lite._draw(logits, specs, u).tolist() for u in uniforms]
    assert probed == full

    def redraw(i: int, factor: float) -> int:
        draw, row = divmod(i, 3)
        nudged = uniforms[draw].copy()
        nudged[row] *= np.float32(factor)
        return lite._draw(logits, specs, nudged)[row]

    assert_same_draws(np.ravel(expected), np.ravel(probed), redraw)
    assert len(np.unique(probed)) > 3


LN_HALF = float(np.float32(-np.log(2.0)))  # its float32 exp is exactly 0.5


@pytest.mark.parametrize("logits, spec, u, token", [
    ([0.0, 0.0], SamplingSpec(), 0.5, 1),  # on the edge of the cumulative mass: the next token
    ([0.0, LN_HALF, LN_HALF], SamplingSpec(min_p=0.5), 0.9, 2),  # p == the floor: kept
    ([0.0, LN_HALF, LN_HALF], SamplingSpec(top_p=0.5), 0.9, 0),  # mass before == top_p: cut
    ([0.0, LN_HALF, LN_HALF, -np.inf], SamplingSpec(), 1.0, 0),  # past the end: the best
], ids=["cdf-edge", "min-p-floor", "top-p-edge", "u-rounds-to-1"])
def test_exact_ties_follow_torch_rules(logits, spec, u, token):
    """Probabilities that are exact in float32 (0.5, 0.25), so both sides meet the same tie."""
    x = np.array([logits], dtype=np.float32)
    expected = ref._draw(torch.from_numpy(x), [spec], torch.tensor([u])).tolist()
    assert lite._draw(x, [spec], np.array([u], dtype=np.float32)).tolist() == expected == [token]


def test_uniforms_are_torch_float32_values():
    specs = [SamplingSpec(seed=s) for s in range(50)]
    positions = list(range(100, 150))
    got = lite.Sampler(0)._uniforms(specs, positions)
    assert got.dtype == np.float32
    assert np.array_equal(got, ref.Sampler(0)._uniforms(specs, positions).numpy())


# ------------------------------------------------------------------ through the Sampler


def test_mixed_batch_gets_torch_tokens_for_seeded_and_greedy_rows():
    kinds = [SamplingSpec(temperature=1.0), SamplingSpec(temperature=0.6, top_p=0.9),
             SamplingSpec(temperature=1.4, top_k=50), SamplingSpec(temperature=1.0, min_p=0.05),
             SamplingSpec(temperature=0.9, top_k=200, top_p=0.95, min_p=0.01)]
    specs = []
    for i in range(70):
        if i % 7 == 5:
            specs.append(kinds[i % 5])  # unseeded: numpy's stream, not compared
        elif i % 7 == 6:
            specs.append(SamplingSpec(temperature=0.0, logprobs=i % 6))
        else:
            specs.append(seeded(msgspec.structs.replace(kinds[i % 5], logprobs=i % 3 or None),
                                seed=1000 + i))
    logits = rand_logits(70, seed=11)
    positions = [3 + 5 * i for i in range(70)]
    _, got = run_both(logits, specs, positions)
    assert len(set(got.token_ids)) > 40
    # Without the unseeded rows (the groups' choices stay the same), the rest do not move.
    kept = [i for i in range(70) if i % 7 != 5]
    alone = lite.Sampler(9).sample(logits[kept], [specs[i] for i in kept],
                                   [positions[i] for i in kept])
    assert alone.token_ids == [got.token_ids[i] for i in kept]


def test_batch_invariant_mode_groups_like_torch():
    kinds = [SamplingSpec(temperature=1.0), SamplingSpec(temperature=0.8, top_p=0.9),
             SamplingSpec(temperature=1.0, top_k=20), SamplingSpec(temperature=0.7, top_k=20,
                                                                   top_p=0.8),
             SamplingSpec(temperature=0.0)]
    specs = [seeded(kinds[i % len(kinds)], seed=7 * i) if i % 5 != 4 else kinds[4]
             for i in range(25)]
    run_both(rand_logits(25, seed=12), specs, [9] * 25, batch_invariant=True)
    # Plain rows beside top-k rows only: their own group, drawn unsorted (one group would
    # sort them, and another token would come out).
    specs = [seeded(kinds[i % 2 * 2], seed=3 * i) for i in range(20)]
    run_both(rand_logits(20, seed=18), specs, [9] * 20, batch_invariant=True)


PENALTIES = [
    SamplingSpec(repetition_penalty=1.3),
    SamplingSpec(frequency_penalty=0.7, presence_penalty=-0.4),
    SamplingSpec(repetition_penalty=0.8, frequency_penalty=-1.5, presence_penalty=2.0,
                 logit_bias={5: -100.0, 17: 3.25, 40: 100.0}),
    SamplingSpec(logit_bias={0: 1.5, 3: -2.0, V + 3: 9.0}),  # out of the vocabulary: dropped
    SamplingSpec(),
]


def _history(i: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(i)
    return rng.integers(0, 60, 30).tolist(), rng.integers(0, 60, 25).tolist()


def test_penalties_and_bias_adjust_logits_to_the_bit():
    logits = rand_logits(len(PENALTIES), seed=13)
    histories = [_history(i) if i < 4 else None for i in range(len(PENALTIES))]
    t = torch.from_numpy(logits.copy())
    n = logits.copy()
    ref.apply_penalties(t, PENALTIES, [ref.TokenHistory(s, *h, V) if h else None
                                       for s, h in zip(PENALTIES, histories)])
    lite.apply_penalties(n, PENALTIES, [lite.TokenHistory(s, *h, V) if h else None
                                        for s, h in zip(PENALTIES, histories)])
    np.testing.assert_array_equal(n, t.numpy())
    assert not np.array_equal(n[:4], logits[:4]) and np.array_equal(n[4], logits[4])


def test_penalised_rows_sample_like_torch():
    specs = [msgspec.structs.replace(s, temperature=t, seed=s_, logprobs=2)
             for s, t, s_ in zip(PENALTIES, (0.0, 1.0, 0.8, 1.0, 1.0), (None, 1, 2, 3, 4))]
    specs += [seeded(msgspec.structs.replace(PENALTIES[0], top_p=0.9), 5)]
    logits = rand_logits(len(specs), scale=1.0, seed=14)
    histories = [_history(i) for i in range(len(specs))]
    expected, got = run_both(logits, specs, history=histories)
    assert got.token_ids[2] == 40  # the +100 bias forces it
    assert got.logprobs[2].top_token_ids == expected.logprobs[2].top_token_ids  # raw logits


def test_token_history_bookkeeping():
    spec = SamplingSpec(frequency_penalty=0.1, repetition_penalty=1.3)
    grown = lite.TokenHistory(spec, [5, 6, 5], [], 100)
    for step in ([7], [7, 5], [9]):
        grown.add_output(step)
    fresh = lite.TokenHistory(spec, [5, 6, 5], [7, 7, 5, 9], 100)
    torch_side = ref.TokenHistory(spec, [5, 6, 5], [7, 7, 5, 9], 100)
    assert grown.output_counts() == fresh.output_counts() == torch_side.output_counts() == {
        7: 2, 5: 1, 9: 1}
    assert sorted(grown.seen_ids.tolist()) == sorted(torch_side.seen_ids.tolist()) == [5, 6, 7, 9]
    assert grown.prompt_len == 3
    assert lite.TokenHistory(SamplingSpec(logit_bias={1: 2.0}), [1], [1], 10).count_ids is None
    assert lite.TokenHistory(SamplingSpec(logit_bias={3: 1.0, 99: 5.0}), [0], [], 5
                             ).bias_ids.tolist() == [3]


def _bitmask(rows: int, vocab: int, allowed: int, seed: int) -> bytes:
    """``rows`` grammar rows in xgrammar's layout, each allowing ``allowed`` random tokens."""
    rng = np.random.default_rng(seed)
    words = np.zeros((rows, (vocab + 31) // 32), dtype=np.uint32)
    for r in range(rows):
        for t in rng.choice(vocab, allowed, replace=False):
            words[r, t // 32] |= np.uint32(1 << (t % 32))
    return words.tobytes()


def test_structured_mask_rows():
    vocab = 1000  # not a multiple of 32: the last word's high bits are past the vocabulary
    sampled = ["a", "b", "c", "d"]
    mask = (["d", "b"], _bitmask(2, vocab, 12, seed=15), sampled)
    t_rows, t_words = ref.structured_token_mask(*mask)
    n_rows, n_words = lite.structured_token_mask(*mask)
    assert n_rows.tolist() == t_rows.tolist() == [3, 1]
    assert np.array_equal(n_words, t_words.numpy())
    logits = rand_logits(4, vocab, seed=16)
    logits[1, 0] = 80.0  # a raw favourite the grammar may forbid
    specs = [seeded(SamplingSpec(temperature=1.0, logprobs=3), 1),
             SamplingSpec(temperature=0.0, logprobs=1),
             SamplingSpec(temperature=1.0),
             seeded(SamplingSpec(temperature=0.7, top_p=0.8, logit_bias={2: 5.0}), 2)]
    history = [None, None, None, ([1, 2], [])]
    allowed = {r: set(np.flatnonzero(np.isfinite(row)).tolist())
               for r, row in zip((3, 1), _masked(logits, mask))}
    for seed in range(10):
        specs[3] = seeded(specs[3], seed)
        _, got = run_both(logits, specs, history=history, mask=mask)
        assert got.token_ids[3] in allowed[3] and got.token_ids[1] in allowed[1]
        assert got.logprobs[1].top_token_ids == [0]  # from the raw logits
    assert lite.structured_token_mask([], b"", ["a"]) is None
    with pytest.raises(ValueError, match="samples no token"):
        lite.structured_token_mask(["zz"], mask[1][:len(mask[1]) // 2], ["a"])
    with pytest.raises(ValueError, match="covers"):
        lite.apply_token_mask(rand_logits(1, 2000), (np.array([0]), n_words[:1]))


def _masked(logits: np.ndarray, mask) -> np.ndarray:
    rows, words = lite.structured_token_mask(*mask)
    out = logits.copy()
    lite.apply_token_mask(out, (rows, words))
    return out[rows]


def test_logprobs_of_every_width():
    specs = [SamplingSpec(temperature=t, top_k=k, top_p=p, seed=s, logprobs=n)
             for n, (t, k, p, s) in enumerate([(0.0, 0, 1.0, None), (0.3, 5, 0.9, 1),
                                               (2.0, 0, 0.5, 2), (1.0, 0, 1.0, 3),
                                               (0.0, 0, 1.0, None), (1.0, 50, 0.95, 4)])]
    specs.append(SamplingSpec(temperature=0.0))  # asked none
    logits = rand_logits(len(specs), seed=17)
    expected, got = run_both(logits, specs)
    assert [len(lp.top_token_ids) for lp in got.logprobs[:6]] == [0, 1, 2, 3, 4, 5]
    assert got.logprobs[6] is None and expected.logprobs[6] is None
    raw = logits.astype(np.float64)
    raw = raw - raw.max(-1, keepdims=True)
    raw -= np.log(np.exp(raw).sum(-1, keepdims=True))
    for row, (token, lp) in enumerate(zip(got.token_ids, got.logprobs[:6])):
        assert lp.logprob == pytest.approx(raw[row, token], abs=1e-5)
    # Equal raw values, which torch's topk leaves in no defined order: here, id order.
    logits[4, [300, 100, 200]] = 30.0
    tied = lite.Sampler(0).sample(logits[4:5], specs[4:5], [7]).logprobs[0]
    assert tied.top_token_ids == [100, 200, 300, int(np.argsort(-logits[4])[3])]
    assert tied.top_logprobs[0] == tied.top_logprobs[1] == tied.top_logprobs[2]


# ------------------------------------------------------------------ unseeded rows


def test_unseeded_draws_follow_the_distribution():
    probs = np.array([0.5, 0.3, 0.12, 0.08])
    logits = np.tile(np.log(probs).astype(np.float32), (2000, 1))
    tokens = lite.Sampler(3).sample(logits, [SamplingSpec(temperature=1.0)] * 2000,
                                    [0] * 2000).token_ids
    counts = np.bincount(tokens, minlength=4)
    expected = 2000 * probs
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, (counts, chi2)  # 3 degrees of freedom: p < 1e-4 to fail by chance


def test_the_sampler_seed_reproduces_the_unseeded_stream():
    logits = np.zeros((4, 1000), dtype=np.float32)
    specs = [SamplingSpec(temperature=1.0)] * 4

    def stream(seed: int) -> list[list[int]]:
        sampler = lite.Sampler(seed)
        return [sampler.sample(logits.copy(), specs, [0] * 4).token_ids for _ in range(3)]

    a = stream(5)
    assert a == stream(5)
    assert len(set(map(tuple, a))) == 3 and a != stream(6)  # the stream moves on


def test_the_module_does_not_import_torch():
    code = "import sys, pocketllm.workers.lite.sampler; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)

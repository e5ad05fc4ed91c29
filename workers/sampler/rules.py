"""Token sampling: the one set of rules both workers follow, written once against a thin
array backend: the module ``numpy_ops`` for the torch-free CPU worker, ``torch_ops`` for
the torch worker on any device (whose ranking is exact unless more than
``torch_ops.TIE_MARGIN`` tokens share the value at a cut's edge).

Per row of a step, in this order:

1. Log probabilities, if asked, from the logits as they came (float64 log-softmax).
2. Penalties and bias, for the rows that use them: repetition (HF/CTRL rule over prompt +
   output: a positive logit divided by the penalty, a negative one multiplied), then
   frequency and presence (OpenAI rule, output only: ``-= f * count + p * (count > 0)``),
   then ``logit_bias`` last, so a -100/+100 bias still bans/forces whatever the penalties
   did. Float32, on the logits in place.
3. The grammar's mask: forbidden tokens get -inf.
4. Greedy rows (temperature 0 or top_k 1): the first maximum of the adjusted logits.
5. Every other row, in float64: ``x = logits / temperature``, its tokens ranked by value
   and, among equal values, by id (the lower first), then cut:
   - top-k: the first k ranks stay (transformers keeps every token equal to the k-th;
     here the ranking decides, so the kept set never depends on a sort's tie order);
   - top-p: of what top-k kept, a rank stays while the probability of the ranks before
     it is below ``top_p`` (probabilities ``exp(x - logsumexp)`` and their running sums
     in float64, exact to about 1e-16);
   - min-p: a token whose probability is below ``min_p`` times the best one's is dropped
     (``exp(x - max) < min_p``: the ratio does not change when the cuts renormalise);
   then one inverse-CDF draw over the kept tokens **in token-id order**: weights
   ``exp(x - max)``, running sums in float64, the first token whose sum exceeds ``u``
   times the total. ``u`` is ``seeded_uniform(seed, position)`` for a seeded row (53
   bits, so it never reaches 1), else the next number of the sampler's own stream.

Nothing in step 5 looks at another row: no shared sort, width or probe decides how a row's
mass is laid out, so a seeded row draws the same token whatever shares its step (up to
float64 rounding of its own sums, ~1e-16, where a device's reduction order differs).
Only the best tokens a cut can keep are looked at: the widest top-k of the step, or the
best ``NUCLEUS_PROBE`` for a row with top-p alone, whose whole row is ranked only when
they hold less than ``top_p`` (both give the same prefix sums, so the same cut).
"""

from __future__ import annotations

import collections
import copy
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from pocketllm.proto.messages import SamplingSpec, TokenLogprobs

logger = logging.getLogger("pocketllm.worker")

# Top-p over a 262k vocabulary: a full sort costs more than a decode step on CPU, while
# the nucleus of a real distribution almost always lies within its best few hundred tokens.
# With torch's tie margin (torch_ops.TIE_MARGIN) the probe's top-k asks for 1,024 values,
# the most CUDA's top-k takes without sorting the rows (1,088 was 3x slower on an H200).
NUCLEUS_PROBE = 960
_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) from (seed, position): two rounds of splitmix64."""
    x = (seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    for _ in range(2):
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        x = z ^ (z >> 31)
    return (x >> 11) / float(1 << 53)


def is_greedy(spec: SamplingSpec) -> bool:
    return spec.temperature == 0 or spec.top_k == 1


def uses_output_counts(spec: SamplingSpec) -> bool:
    return spec.frequency_penalty != 0.0 or spec.presence_penalty != 0.0


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[Optional[TokenLogprobs]]


class TokenHistory:
    """What one request's penalties need, kept up to date token by token (never recounted).

    Small host arrays, whatever the device: ``apply_penalties`` flattens every row's into
    one index and hands it to the backend once per step.
    ``count_ids``/``counts``: distinct generated tokens and how often each came
    (frequency/presence only; never the prompt). ``seen_ids``: distinct tokens of
    prompt + output (repetition only). ``bias_ids``/``bias_values``: logit_bias, once.
    """

    def __init__(self, spec: SamplingSpec, prompt_ids: Sequence[int], output_ids: Sequence[int],
                 vocab_size: int):
        self.prompt_len = len(prompt_ids)
        self.count_ids = self.counts = None
        self._slots: dict[int, int] = {}  # token -> its index in count_ids
        if uses_output_counts(spec):
            self.count_ids = np.empty(0, dtype=np.int64)
            self.counts = np.empty(0, dtype=np.float32)
        self.seen_ids = None
        self._seen: set[int] = set()
        if spec.repetition_penalty != 1.0:
            self._seen = set(prompt_ids)
            self.seen_ids = np.array(sorted(self._seen), dtype=np.int64)
        self.bias_ids = self.bias_values = None
        if spec.logit_bias:
            # The control plane refuses out-of-vocabulary ids; never index past the logits.
            bias = {t: b for t, b in spec.logit_bias.items() if 0 <= t < vocab_size}
            if len(bias) != len(spec.logit_bias):
                logger.warning("logit_bias ids outside the vocabulary (%d) dropped", vocab_size)
            self.bias_ids = np.array(list(bias), dtype=np.int64)
            self.bias_values = np.array(list(bias.values()), dtype=np.float32)
        self.add_output(output_ids)

    def add_output(self, token_ids: Iterable[int]) -> None:
        token_ids = list(token_ids)
        if not token_ids:
            return
        if self.count_ids is not None:
            new_ids, new_counts = [], []
            for token, n in collections.Counter(token_ids).items():
                slot = self._slots.get(token)
                if slot is None:
                    self._slots[token] = len(self._slots)
                    new_ids.append(token)
                    new_counts.append(n)
                else:
                    self.counts[slot] += n
            if new_ids:
                self.count_ids = np.concatenate([self.count_ids, np.array(new_ids, np.int64)])
                self.counts = np.concatenate([self.counts, np.array(new_counts, np.float32)])
        if self.seen_ids is not None:
            new = [t for t in dict.fromkeys(token_ids) if t not in self._seen]
            if new:
                self._seen.update(new)
                self.seen_ids = np.concatenate([self.seen_ids, np.array(new, np.int64)])

    def extended(self, token_ids: Sequence[int]) -> "TokenHistory":
        """This history as a draft's row sees it: the drafts before it counted as generated
        (a copy; this one is unchanged, since the drafts may be rejected)."""
        if not token_ids:
            return self
        other = copy.copy(self)
        other._slots, other._seen = dict(self._slots), set(self._seen)
        if self.counts is not None:
            other.counts = self.counts.copy()  # add_output adds to it in place
        other.add_output(token_ids)
        return other

    def output_counts(self) -> dict[int, int]:
        """token -> times generated (for tests and debugging; not on the hot path)."""
        if self.count_ids is None:
            return {}
        return dict(zip(self.count_ids.tolist(), map(int, self.counts.tolist())))


def apply_penalties(xp, logits, specs: Sequence[SamplingSpec],
                    histories: Sequence[Optional[TokenHistory]]) -> None:
    """Adjust, in place, the rows whose history is not None (step 2 of the rules). Each
    kind names a (row, token) at most once, so a gather and a scatter apply it."""
    repeated, counted, biased = [], [], []  # (row, ids, one value per id)
    for row, (spec, h) in enumerate(zip(specs, histories)):
        if h is None:
            continue
        if h.seen_ids is not None:
            repeated.append((row, h.seen_ids, np.full(len(h.seen_ids), spec.repetition_penalty,
                                                      dtype=np.float32)))
        if h.count_ids is not None and len(h.count_ids):
            delta = -(h.counts * np.float32(spec.frequency_penalty)
                      + np.float32(spec.presence_penalty))
            counted.append((row, h.count_ids, delta))
        if h.bias_ids is not None:
            biased.append((row, h.bias_ids, h.bias_values))
    if repeated:
        rows, ids, factor = _flat(xp, logits, repeated)
        values = logits[rows, ids]
        logits[rows, ids] = xp.where(values > 0, values / factor, values * factor)
    for parts in (counted, biased):  # frequency/presence first, the bias last
        if parts:
            rows, ids, delta = _flat(xp, logits, parts)
            logits[rows, ids] = logits[rows, ids] + delta


def _flat(xp, like, parts: list[tuple[int, np.ndarray, np.ndarray]]) -> tuple:
    """(rows, ids, values) of every entry of every row, as backend arrays beside ``like``."""
    rows = np.concatenate([np.full(len(ids), row, dtype=np.int64) for row, ids, _v in parts])
    ids = np.concatenate([ids for _r, ids, _v in parts])
    values = np.concatenate([v for _r, _i, v in parts])
    return xp.put(rows, like), xp.put(ids, like), xp.put(values, like)


def structured_token_mask(request_ids: Sequence[str], bitmask: bytes,
                          sampled_ids: Sequence[str]) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """A plan's grammar bitmask as (sample rows, int32 words [rows, ceil(V/32)]); None when
    no request of the step is structured (then the sampler does no extra work)."""
    if not request_ids:
        return None
    rows_of = collections.defaultdict(collections.deque)  # a request with drafts: several
    for i, rid in enumerate(sampled_ids):
        rows_of[rid].append(i)
    rows = []
    for rid in request_ids:  # a request's rows in order: its first token's, then its drafts'
        if not rows_of.get(rid):
            raise ValueError(f"a grammar bitmask row for {rid!r}, which samples no token "
                             "(or no more tokens) here")
        rows.append(rows_of[rid].popleft())
    words = np.frombuffer(bitmask, dtype="<i4").reshape(len(request_ids), -1)
    return np.array(rows, dtype=np.int64), words


def apply_token_mask(xp, logits, mask: tuple[np.ndarray, np.ndarray]) -> None:
    """In place: tokens the grammar forbids get -inf (bit j of word w allows token 32w + j)."""
    rows, words = mask
    vocab = logits.shape[-1]
    if words.shape[-1] * 32 < vocab:
        raise ValueError(f"grammar bitmask covers {words.shape[-1] * 32} tokens, logits {vocab}")
    rows = xp.put(rows, logits)
    allowed = xp.unpack_bits(xp.put(words, logits))[:, :vocab]
    logits[rows] = xp.where(allowed, logits[rows], -float("inf"))


class Sampler:
    """Steps 1-5 for one step's rows. ``xp``: the array backend. ``seed``: the stream of
    unseeded rows (numpy's, on every backend), itself seeded for reproducible runs."""

    def __init__(self, xp, seed: int):
        self.xp = xp
        self.stream = np.random.default_rng(seed)

    def __call__(self, logits, specs: Sequence[SamplingSpec], positions: Sequence[int],
                 histories: Optional[Sequence[Optional[TokenHistory]]] = None,
                 token_mask: Optional[tuple[np.ndarray, np.ndarray]] = None) -> SampleOutput:
        """logits [B, V] float32; ``positions[i]`` is the position the new token will take.

        ``histories``: None when no row uses penalties or bias (the common case, no work);
        else one per row, None for rows that use none. Penalised rows of ``logits`` are
        adjusted in place, after the raw rows that logprobs need were copied out.
        """
        return self.collect(self.to_host(*self.draw(logits, specs, positions, histories,
                                                    token_mask)), specs)

    def draw(self, logits, specs: Sequence[SamplingSpec], positions: Sequence[int],
             histories: Optional[Sequence[Optional[TokenHistory]]] = None,
             token_mask: Optional[tuple[np.ndarray, np.ndarray]] = None) -> tuple[Any, list]:
        """(tokens [B] where the logits are, the logprob tables there: [] when no row asked)."""
        xp = self.xp
        asked = [i for i, s in enumerate(specs) if s.logprobs is not None]
        asked_at = xp.put(np.array(asked), logits) if asked else None
        raw = logits[asked_at] if asked else None
        if histories is not None:
            apply_penalties(xp, logits, specs, histories)
        if token_mask is not None:
            apply_token_mask(xp, logits, token_mask)
        tokens = xp.argmax(logits)
        random_rows = [i for i, s in enumerate(specs) if not is_greedy(s)]
        if random_rows:
            index = xp.put(np.array(random_rows), logits)
            tokens[index] = draw_rows(xp, logits[index], [specs[i] for i in random_rows],
                                      self._uniforms([specs[i] for i in random_rows],
                                                     [positions[i] for i in random_rows]))
        tables = [] if raw is None else logprob_tables(xp, raw, tokens[asked_at],
                                                       max(specs[i].logprobs for i in asked))
        return tokens, tables

    def to_host(self, tokens, tables: list):
        """Start the copies of what ``collect`` returns, without waiting for them."""
        return self.xp.to_host([tokens] + tables)

    def collect(self, copy, specs: Sequence[SamplingSpec]) -> SampleOutput:
        """Waits for the copies and builds tokens and logprobs."""
        tokens, *tables = self.xp.lists(copy)
        return SampleOutput(tokens, logprob_lists(tables, specs))

    def _uniforms(self, specs: Sequence[SamplingSpec], positions: Sequence[int]) -> np.ndarray:
        shared = iter(self.stream.random(sum(s.seed is None for s in specs)).tolist())
        return np.array([seeded_uniform(s.seed, p) if s.seed is not None else next(shared)
                         for s, p in zip(specs, positions)], dtype=np.float64)


def draw_rows(xp, logits, specs: Sequence[SamplingSpec], uniforms: np.ndarray):
    """Step 5: one token per row of ``logits`` [R, V] (float32, R >= 1)."""
    vocab = logits.shape[-1]
    cutting = [i for i, s in enumerate(specs) if 0 < s.top_k < vocab or s.top_p < 1.0]
    uncut = [i for i in range(len(specs)) if i not in set(cutting)]
    tokens = None
    for rows, draw in ((cutting, _draw_cut), (uncut, _draw_uncut)):
        if len(rows) == len(specs):
            return draw(xp, logits, specs, uniforms)
        if rows:
            at = xp.put(np.array(rows), logits)
            tokens = xp.argmax(logits) if tokens is None else tokens
            tokens[at] = draw(xp, logits[at], [specs[i] for i in rows], uniforms[rows])
    return tokens


def _draw_uncut(xp, logits, specs, uniforms):
    """Rows without top-k or top-p: every token, in id order."""
    x = _scaled(xp, logits, specs)
    return _inverse_cdf(xp, _min_p(xp, xp.exp(x - xp.rowmax(x)), specs), uniforms)


def _draw_cut(xp, logits, specs, uniforms):
    """Rows with top-k or top-p: their kept tokens lie among their best ``width`` (the
    widest top-k, or the probe for a row with top-p alone), so only those are looked at;
    the whole row is sorted when a nucleus turns out wider than the probe."""
    vocab = logits.shape[-1]
    width = max(s.top_k if 0 < s.top_k < vocab else NUCLEUS_PROBE for s in specs)
    cut = _cut(xp, logits, specs, width) if width < vocab else None
    ids, weights = cut if cut is not None else _cut(xp, logits, specs, vocab)
    order = xp.argsort(ids)  # the draw walks the kept tokens in id order
    choice = _inverse_cdf(xp, _min_p(xp, xp.gather(weights, order), specs), uniforms)
    return xp.gather(xp.gather(ids, order), choice[:, None])[:, 0]


def _cut(xp, logits, specs, width: int):
    """(ids [R, width], weights ``exp(x - max)``, 0 where top-k or top-p cut) of each row's
    best ``width`` tokens, ranked by value and then by id; None when a row's nucleus may
    reach past them."""
    vocab = logits.shape[-1]
    values, ids = xp.top(logits, width)  # best first, equal values in id order
    v = _scaled(xp, values, specs)
    ranks = xp.put(np.arange(width)[None, :], v)
    top_ks = [s.top_k if 0 < s.top_k < vocab else vocab for s in specs]
    kept = ranks < _column(xp, top_ks, v)
    nucleus = [i for i, s in enumerate(specs) if s.top_p < 1.0]
    if nucleus:
        at = xp.put(np.array(nucleus), v)
        # The nucleus is measured within what top-k kept: a row without top-k over its
        # whole vocabulary, so its normaliser comes from the whole row.
        lse = xp.logsumexp(xp.where(kept[at], v[at], -float("inf")))
        whole = [j for j, i in enumerate(nucleus) if top_ks[i] == vocab]
        if whole and width < vocab:
            rows = xp.put(np.array([nucleus[j] for j in whole]), v)
            lse[xp.put(np.array(whole), v)] = xp.logsumexp(
                _scaled(xp, logits[rows], [specs[nucleus[j]] for j in whole]))
        mass = xp.where(kept[at], xp.exp(v[at] - lse), 0.0)
        running = xp.cumsum(mass)
        top_p = _column(xp, [specs[i].top_p for i in nucleus], v)
        if width < vocab and bool((running[:, -1:] < top_p).any()):
            return None  # some row's best ``width`` hold less than its top_p
        before = running - mass  # of which only the first column stays: exactly 0
        before[:, 1:] = running[:, :-1]  # the mass of the ranks before, as summed
        kept[at] = kept[at] & (before < top_p)
    return ids, xp.where(kept, xp.exp(v - v[:, :1]), 0.0)


def _scaled(xp, logits, specs):
    """``x``: the logits over the temperature, in float64."""
    return xp.float64(logits) / _column(xp, [s.temperature for s in specs], logits)


def _min_p(xp, weights, specs):
    """Drops tokens below min_p times the best one's probability (weights exp(x - max))."""
    if not any(s.min_p > 0.0 for s in specs):
        return weights
    return xp.where(weights >= _column(xp, [s.min_p for s in specs], weights), weights, 0.0)


def _inverse_cdf(xp, weights, uniforms: np.ndarray):
    """Per row, the first position whose running weight exceeds u times the total."""
    cdf = xp.cumsum(weights)
    choice = xp.first_above(cdf, xp.put(uniforms[:, None], cdf) * cdf[:, -1:])
    choice = choice.clip(max=weights.shape[-1] - 1)
    # A device's parallel scan may round a sum so that the first one above lands on a
    # zero weight; such a row takes its most likely token instead.
    landed = xp.gather(weights, choice[:, None])[:, 0] > 0
    return xp.where(landed, choice, xp.argmax(weights))


def _column(xp, values: list, like):
    """One number per row as an [R, 1] backend array (float64, or int64 for ints)."""
    return xp.put(np.array(values)[:, None], like)


def logprob_tables(xp, raw, chosen_ids, k: int) -> list:
    """[chosen, top values, top ids] for the rows that asked: float64 log-softmax of the raw
    logits; the top lists as wide as the widest request, equal values in id order."""
    lse = xp.logsumexp(xp.float64(raw))
    _values, top_ids = xp.top(raw, min(k, raw.shape[-1]))
    return [xp.float64(xp.gather(raw, chosen_ids[:, None]))[:, 0] - lse[:, 0],
            xp.float64(xp.gather(raw, top_ids)) - lse, top_ids]


def logprob_lists(tables: list[list], specs: Sequence[SamplingSpec]
                  ) -> list[Optional[TokenLogprobs]]:
    """Per row, its TokenLogprobs or None. ``tables``: [] when no row asked, else [chosen,
    top values, top ids] as lists over the rows that asked, top lists as wide as the widest
    request (each row keeps its own ``logprobs`` of them)."""
    out: list[Optional[TokenLogprobs]] = [None] * len(specs)
    if not tables:
        return out
    chosen, top_vals, top_ids = tables
    asked = [i for i, s in enumerate(specs) if s.logprobs is not None]
    for j, i in enumerate(asked):
        n = specs[i].logprobs
        out[i] = TokenLogprobs(chosen[j], top_ids[j][:n], top_vals[j][:n])
    return out

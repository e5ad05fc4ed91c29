"""Token sampling with numpy only: a port of the torch sampler (workers/layers/sampler.py)
for the CPU worker, which must not pay for importing torch.

Same rules in the same order: penalties and logit_bias on the rows that use them, then
the grammar mask, then per row greedy (temperature 0 or top_k 1: the first maximum), or
temperature, top-k, top-p (with the same NUCLEUS_PROBE shortcut), min-p and one
inverse-CDF draw. Rows are drawn in the same groups as there (one group, or one per
top-k width when batch-invariant), since a group's shared choices (sort or not, how
wide, probe or not) decide which token a uniform number lands on. A seeded row's
uniform is ``seeded_uniform(seed, position)``, rounded to float32 as there; logprobs
come from the raw logits.

What can differ from the torch sampler, and why:

* Unseeded rows draw their uniforms from a numpy Generator seeded with the Sampler's
  seed: reproducible, but not torch's stream.
* Rounding. What torch does in float32 is done in float32 here (the division by the
  temperature, the min-p floor, the top-p comparison, the uniform times the total mass;
  the uniform itself is rounded to float32 first), and cumulative sums accumulate in
  float64 and round to float32, as torch's CPU cumsum does. Not torch's: exp (now and
  then an ulp apart) and the sum that normalises a softmax. Torch's CPU softmax keeps 8
  (AVX2) or 16 (AVX-512) float32 running totals, which lose about 1e-7 of the sum over a
  few thousand tokens but up to 5e-5 over 262k; numpy's pairwise sum stays near 1e-7.
  So a seeded row gets torch's token unless one of its comparisons is a tie to within
  that rounding: the uniform on the edge between two tokens' cumulative mass, a
  probability at the min-p floor, the mass before a token at top_p. Over a few thousand
  tokens: none in thousands of draws. Over 262k (random rows, measured): 1 in 1000
  plain draws; 1 in 50 with min-p (a row with a token at the floor); with top-p, none
  where the probe settles the cut (it normalises with logsumexp, which torch sums
  accurately), but 8 to 30% where the full sort must: torch's cut then strays a few
  tail tokens from the exact one, while numpy's matched a float64 reference every time.
* Equal values. Torch's CPU topk and sort leave equal values in no defined order; here
  the lower token id comes first. That orders tied top logprobs and decides which of
  two equally likely tokens a sorted draw maps to; a top-k cut through tied values keeps
  whichever numpy's partition kept.
* Logprobs: within 2e-6 of torch's over a few thousand tokens; over 262k torch's own are
  off by up to 5e-5 (the softmax sum again), these by a few 1e-6.
"""

from __future__ import annotations

import collections
import logging
from typing import Iterable, Optional, Sequence

import numpy as np

from pocketllm.proto.messages import SamplingSpec
from pocketllm.sampling import (NUCLEUS_PROBE, SampleOutput, is_greedy, logprob_lists,
                                seeded_uniform, uses_output_counts)

logger = logging.getLogger("pocketllm.worker")

F32 = np.float32


class TokenHistory:
    """What one request's penalties need, kept up to date token by token (never recounted).

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
            self.counts = np.empty(0, dtype=F32)
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
            self.bias_values = np.array(list(bias.values()), dtype=F32)
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
                self.counts = np.concatenate([self.counts, np.array(new_counts, F32)])
        if self.seen_ids is not None:
            new = [t for t in dict.fromkeys(token_ids) if t not in self._seen]
            if new:
                self._seen.update(new)
                self.seen_ids = np.concatenate([self.seen_ids, np.array(new, np.int64)])

    def output_counts(self) -> dict[int, int]:
        """token -> times generated (for tests and debugging; not on the hot path)."""
        if self.count_ids is None:
            return {}
        return dict(zip(self.count_ids.tolist(), map(int, self.counts.tolist())))


def apply_penalties(logits: np.ndarray, specs: Sequence[SamplingSpec],
                    histories: Sequence[Optional[TokenHistory]]) -> None:
    """Adjust, in place, the rows whose history is not None: repetition first, then
    frequency/presence, then logit_bias (float32 throughout, as the torch version)."""
    repeated, counted, biased = [], [], []  # (row, ids, values per id)
    for row, (spec, h) in enumerate(zip(specs, histories)):
        if h is None:
            continue
        if h.seen_ids is not None:
            repeated.append((row, h.seen_ids, np.full(len(h.seen_ids), spec.repetition_penalty,
                                                      dtype=F32)))
        if h.count_ids is not None and len(h.count_ids):
            # OpenAI: mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty
            delta = -(h.counts * F32(spec.frequency_penalty) + F32(spec.presence_penalty))
            counted.append((row, h.count_ids, delta))
        if h.bias_ids is not None:
            biased.append((row, h.bias_ids, h.bias_values))
    if repeated:
        rows, ids, factor = _flat(repeated)
        values = logits[rows, ids]
        # HF/CTRL: a positive logit is divided by the penalty, a negative one multiplied.
        logits[rows, ids] = np.where(values > 0, values / factor, values * factor)
    # Each kind names a (row, token) at most once, so += adds every entry; the counted
    # part goes first, as in torch's accumulating scatter, so float32 rounds the same.
    for parts in (counted, biased):
        if parts:
            rows, ids, delta = _flat(parts)
            logits[rows, ids] += delta


def _flat(parts: list[tuple[int, np.ndarray, np.ndarray]]
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, ids, values) of every entry of every row, for one fancy-indexed update."""
    rows = np.concatenate([np.full(len(ids), row, dtype=np.int64) for row, ids, _v in parts])
    return (rows, np.concatenate([ids for _r, ids, _v in parts]),
            np.concatenate([v for _r, _i, v in parts]))


def structured_token_mask(request_ids: Sequence[str], bitmask: bytes,
                          sampled_ids: Sequence[str]) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """A plan's grammar bitmask as (sample rows, int32 words [rows, ceil(V/32)]); None when
    no request of the step is structured (then the sampler does no extra work)."""
    if not request_ids:
        return None
    where = {rid: i for i, rid in enumerate(sampled_ids)}
    missing = [rid for rid in request_ids if rid not in where]
    if missing:
        raise ValueError(f"a grammar bitmask row for {missing[0]!r}, which samples no token here")
    words = np.frombuffer(bitmask, dtype=np.int32).reshape(len(request_ids), -1)
    return np.array([where[rid] for rid in request_ids], dtype=np.int64), words


def apply_token_mask(logits: np.ndarray, mask: tuple[np.ndarray, np.ndarray]) -> None:
    """In place: tokens the grammar forbids get -inf (bit j of word w allows token 32*w + j)."""
    rows, words = mask
    vocab = logits.shape[-1]
    if words.shape[-1] * 32 < vocab:
        raise ValueError(f"grammar bitmask covers {words.shape[-1] * 32} tokens, logits {vocab}")
    # Word w's little-endian bytes, each unpacked low bit first, list tokens 32w..32w+31.
    as_bytes = words.astype("<i4", copy=False).view(np.uint8)
    allowed = np.unpackbits(as_bytes, axis=-1, bitorder="little")[:, :vocab].astype(bool)
    block = logits[rows]
    block[~allowed] = -np.inf
    logits[rows] = block


class Sampler:
    def __init__(self, seed: int, batch_invariant: bool = False):
        # Unseeded requests share one stream, itself seeded for reproducible runs.
        self.generator = np.random.default_rng(seed)
        self.batch_invariant = batch_invariant

    def sample(self, logits: np.ndarray, specs: Sequence[SamplingSpec], positions: Sequence[int],
               histories: Optional[Sequence[Optional[TokenHistory]]] = None,
               token_mask: Optional[tuple[np.ndarray, np.ndarray]] = None) -> SampleOutput:
        """logits [B, V] float32; ``positions[i]`` is the position the new token will take.

        ``histories``: None when no row uses penalties or bias (the common case, no work);
        else one per row, None for rows that use none. Penalised rows of ``logits`` are
        adjusted in place, after the raw rows that logprobs need were copied out.
        """
        raw_rows = _raw_logprob_rows(logits, specs)
        if histories is not None:
            apply_penalties(logits, specs, histories)
        if token_mask is not None:  # grammar rows: after penalties and bias
            apply_token_mask(logits, token_mask)
        tokens = logits.argmax(axis=-1)  # each row's first maximum, as the torch version
        random_rows = [i for i, s in enumerate(specs) if not is_greedy(s)]
        if random_rows:
            uniforms = self._uniforms([specs[i] for i in random_rows],
                                      [positions[i] for i in random_rows])
            for group, at in _draw_groups(random_rows, specs, logits.shape[-1],
                                          self.batch_invariant):
                tokens[group] = _draw(logits[group], [specs[i] for i in group], uniforms[at],
                                      probe=not self.batch_invariant)
        return SampleOutput(tokens.tolist(),
                            logprob_lists(_logprob_tables(raw_rows, tokens, specs), specs))

    def _uniforms(self, specs: Sequence[SamplingSpec], positions: Sequence[int]) -> np.ndarray:
        unseeded = [i for i, s in enumerate(specs) if s.seed is None]
        shared = self.generator.random(len(unseeded)).tolist()
        values = [seeded_uniform(s.seed, p) if s.seed is not None else 0.0
                  for s, p in zip(specs, positions)]
        for i, u in zip(unseeded, shared):
            values[i] = u
        return np.array(values, dtype=F32)  # float32, as torch's: 1 - 2**-26 rounds to 1.0


def _draw_groups(rows: list[int], specs: Sequence[SamplingSpec], vocab: int,
                 batch_invariant: bool) -> list[tuple[list[int], np.ndarray]]:
    """(rows, their places among ``rows``) drawn together: the torch version's groups.
    By default all of them; batch-invariant, one group per top-k width (numpy's row
    arithmetic does not depend on how many rows there are, so no row is doubled)."""
    if not batch_invariant:
        return [(rows, np.arange(len(rows)))]
    by_width: dict[int, list[int]] = {}
    for place, i in enumerate(rows):
        k = specs[i].top_k
        by_width.setdefault(k if 0 < k < vocab else vocab, []).append(place)
    return [([rows[p] for p in places], np.array(places)) for places in by_width.values()]


def _draw(logits: np.ndarray, specs: Sequence[SamplingSpec], uniforms: np.ndarray,
          probe: bool = True) -> np.ndarray:
    """One token per row of ``logits`` [R, V] (float32), ``uniforms`` [R] float32."""
    vocab = logits.shape[-1]
    x = logits / np.array([s.temperature for s in specs], dtype=F32)[:, None]
    top_ks = [s.top_k if 0 < s.top_k < vocab else vocab for s in specs]
    top_ps = [s.top_p for s in specs]
    # As in torch, the whole group is sorted when any row cuts: that changes the order a
    # row's mass is laid out in, hence where its uniform lands, even for rows that do not.
    index = None
    if max(top_ks) < vocab or min(top_ps) < 1.0:
        width, lse = max(top_ks), None
        if probe and width == vocab:
            lse, index = _nucleus(x, top_ps, NUCLEUS_PROBE)
        if index is None:
            index = _best_first(x, width)
        x = np.take_along_axis(x, index, axis=-1)
        ranks = np.arange(x.shape[-1])
        x[ranks[None, :] >= np.array(top_ks)[:, None]] = -np.inf
        if min(top_ps) < 1.0:
            # top-p measures mass in the whole distribution (after any top-k cut)
            probs = _softmax(x) if lse is None else np.exp(x - lse)
            mass_before = _cumsum(probs) - probs
            drop = (mass_before >= np.array(top_ps, dtype=F32)[:, None]) & (ranks[None, :] > 0)
            x[drop] = -np.inf  # the best token always stays
    probs = _softmax(x)
    min_ps = [s.min_p for s in specs]
    if max(min_ps) > 0.0:
        floor = np.array(min_ps, dtype=F32) * probs.max(axis=-1)
        probs[probs < floor[:, None]] = 0.0
    cdf = _cumsum(probs)
    target = uniforms * cdf[:, -1]
    choice = np.array([np.searchsorted(c, t, side="right") for c, t in zip(cdf, target)])
    choice = np.minimum(choice, cdf.shape[-1] - 1)
    # Guard against float edge cases landing on a zero-probability entry.
    rows = np.arange(len(choice))
    choice = np.where(probs[rows, choice] > 0, choice, probs.argmax(axis=-1))
    return choice if index is None else index[rows, choice]


def _nucleus(x: np.ndarray, top_ps: list[float], probe: int
             ) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """(log-normalizers [R, 1], the ``probe`` best ids of each row, best first) when, in
    every row, those tokens already hold ``top_p`` of the mass: cutting inside them then
    gives what the full sort would. (None, None) otherwise."""
    if probe >= x.shape[-1] or max(top_ps) >= 1.0:
        return None, None
    lse = _logsumexp(x)
    index = _best_first(x, probe)
    covered = np.exp(np.take_along_axis(x, index, axis=-1) - lse).sum(axis=-1)
    if (covered >= np.array(top_ps, dtype=F32)).all():
        return lse, index
    return None, None


def _best_first(x: np.ndarray, width: int) -> np.ndarray:
    """The ids of each row's ``width`` largest values, largest first; equal values in id
    order (torch's topk/sort leave them in no defined order)."""
    if width >= x.shape[-1]:
        return np.argsort(-x, axis=-1, kind="stable")
    # The ``width`` best in id order, then a stable sort of their values.
    ids = np.sort(np.argpartition(-x, width - 1, axis=-1)[:, :width], axis=-1)
    order = np.argsort(-np.take_along_axis(x, ids, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(ids, order, axis=-1)


def _softmax(x: np.ndarray) -> np.ndarray:
    # torch's order: exp(x - max), then times one reciprocal of the sum
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e * (F32(1.0) / e.sum(axis=-1, keepdims=True))


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    m = np.where(np.isinf(m), F32(0.0), m)  # an all -inf row stays -inf, not nan
    return np.log(np.exp(x - m).sum(axis=-1, keepdims=True)) + m


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _cumsum(p: np.ndarray) -> np.ndarray:
    """Running sums as torch's CPU cumsum makes them: float64 accumulation, then float32."""
    return np.cumsum(p, axis=-1, dtype=np.float64).astype(F32)


def _raw_logprob_rows(logits: np.ndarray, specs: Sequence[SamplingSpec]) -> Optional[np.ndarray]:
    """A copy of the raw rows whose request asked for logprobs (None if none did)."""
    asked = [i for i, s in enumerate(specs) if s.logprobs is not None]
    return logits[asked] if asked else None


def _logprob_tables(raw_rows: Optional[np.ndarray], tokens: np.ndarray,
                    specs: Sequence[SamplingSpec]) -> list[list]:
    """[chosen, top values, top ids] as lists for the rows that asked ([] if none)."""
    if raw_rows is None:
        return []
    asked = [i for i, s in enumerate(specs) if s.logprobs is not None]
    logp = _log_softmax(raw_rows.astype(F32, copy=False))
    chosen = logp[np.arange(len(asked)), tokens[asked]]
    k = min(max(specs[i].logprobs for i in asked), logp.shape[-1])
    top_ids = _best_first(logp, k) if k > 0 else np.zeros((len(asked), 0), dtype=np.int64)
    top_vals = np.take_along_axis(logp, top_ids, axis=-1)
    return [chosen.tolist(), top_vals.tolist(), top_ids.tolist()]

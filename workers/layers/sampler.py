"""Token sampling for the rows that reached the end of their known tokens.

Per row: greedy when temperature == 0 or top_k == 1; otherwise temperature,
then top-k, top-p and min-p (the order transformers applies them), then one
inverse-CDF draw. A seeded request's uniform number depends only on (seed,
position of the token being sampled), so its text does not depend on what else
is in the batch and survives preemption. Log probabilities come from the raw
logits, before any of these transforms.

Before all that, rows whose request asked for them get penalties and bias
(``apply_penalties``): repetition (HF/CTRL rule, prompt + output), then
frequency and presence (OpenAI rule, output only), then logit_bias last, so a
-100/+100 bias still bans/forces whatever the penalties did. Greedy rows take
the argmax of these adjusted logits. A batch where no row uses them does no
extra work.
"""

from __future__ import annotations

import collections
import logging
from typing import Iterable, Optional, Sequence

import torch

from pocketllm.proto.messages import SamplingSpec
# The torch-free rules, shared with the numpy sampler (workers/lite/sampler.py).
from pocketllm.sampling import (NUCLEUS_PROBE, SampleOutput, is_greedy, logprob_lists,
                                seeded_uniform, uses_output_counts)

from ..device import to_device

logger = logging.getLogger("pocketllm.worker")


class TokenHistory:
    """What one request's penalties need, kept up to date token by token (never recounted).

    Small CPU tensors, whatever the device: ``apply_penalties`` flattens every row's
    into one index and ships it once per step, instead of one transfer per row and kind.
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
            self.count_ids = torch.empty(0, dtype=torch.long)
            self.counts = torch.empty(0, dtype=torch.float32)
        self.seen_ids = None
        self._seen: set[int] = set()
        if spec.repetition_penalty != 1.0:
            self._seen = set(prompt_ids)
            self.seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long)
        self.bias_ids = self.bias_values = None
        if spec.logit_bias:
            # The control plane refuses out-of-vocabulary ids; never index past the logits.
            bias = {t: b for t, b in spec.logit_bias.items() if 0 <= t < vocab_size}
            if len(bias) != len(spec.logit_bias):
                logger.warning("logit_bias ids outside the vocabulary (%d) dropped", vocab_size)
            self.bias_ids = torch.tensor(list(bias), dtype=torch.long)
            self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32)
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
                    new_counts.append(float(n))
                else:
                    self.counts[slot] += n
            if new_ids:
                self.count_ids = torch.cat([self.count_ids, torch.tensor(new_ids)])
                self.counts = torch.cat([self.counts, torch.tensor(new_counts)])
        if self.seen_ids is not None:
            new = [t for t in dict.fromkeys(token_ids) if t not in self._seen]
            if new:
                self._seen.update(new)
                self.seen_ids = torch.cat([self.seen_ids, torch.tensor(new)])

    def output_counts(self) -> dict[int, int]:
        """token -> times generated (for tests and debugging; not on the hot path)."""
        if self.count_ids is None:
            return {}
        return dict(zip(self.count_ids.tolist(), map(int, self.counts.tolist())))


def apply_penalties(logits: torch.Tensor, specs: Sequence[SamplingSpec],
                    histories: Sequence[Optional[TokenHistory]]) -> None:
    """Adjust, in place, the rows whose history is not None.

    The index is built on the CPU for every row at once; on a GPU that costs two small
    copies and a few kernels per kind, whatever the batch. Frequency/presence and
    logit_bias are both additive, so they share one scatter (bias still lands after the
    multiplicative repetition penalty).
    """
    rep, counted, biased = _Rows(), _Rows(), _Rows()
    for row, (spec, h) in enumerate(zip(specs, histories)):
        if h is None:
            continue
        if h.seen_ids is not None:
            rep.add(row, h.seen_ids, spec.repetition_penalty)
        if h.count_ids is not None and len(h.count_ids):
            counted.add(row, h.count_ids, h.counts, spec.frequency_penalty,
                        spec.presence_penalty)
        if h.bias_ids is not None:
            biased.add(row, h.bias_ids, h.bias_values)
    if rep.rows:
        index, (factor,) = rep.flat()
        rows, ids = to_device(index, logits.device).unbind(0)
        factor = to_device(factor, logits.device)
        values = logits[rows, ids].float()
        # HF/CTRL: a positive logit is divided by the penalty, a negative one multiplied.
        logits[rows, ids] = torch.where(values > 0, values / factor, values * factor).to(
            logits.dtype)
    parts = []
    if counted.rows:
        index, (counts, freq, pres) = counted.flat()
        # OpenAI: mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty
        parts.append((index, -(counts * freq + pres)))
    if biased.rows:
        index, (bias,) = biased.flat()
        parts.append((index, bias))
    if parts:
        index = to_device(torch.cat([i for i, _v in parts], dim=1), logits.device)
        delta = to_device(torch.cat([v for _i, v in parts]), logits.device).to(logits.dtype)
        logits.index_put_(tuple(index.unbind(0)), delta, accumulate=True)


class _Rows:
    """Per-row token ids plus values, flattened into one [2, N] (row, id) index."""

    def __init__(self):
        self.rows: list[int] = []
        self.ids: list[torch.Tensor] = []
        self.columns: list[list] = []  # each: a per-entry tensor, or one number per row

    def add(self, row: int, ids: torch.Tensor, *values) -> None:
        self.rows.append(row)
        self.ids.append(ids)
        self.columns.append(list(values))

    def flat(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        lengths = torch.tensor([len(i) for i in self.ids])
        rows = torch.tensor(self.rows).repeat_interleave(lengths)
        index = torch.stack([rows, torch.cat(self.ids)])
        values = []
        for column in zip(*self.columns):
            if isinstance(column[0], torch.Tensor):
                values.append(torch.cat(column))
            else:  # one number per row, spread over that row's ids
                values.append(torch.tensor(column, dtype=torch.float32).repeat_interleave(lengths))
        return index, values


def structured_token_mask(request_ids: Sequence[str], bitmask: bytes,
                          sampled_ids: Sequence[str]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """A plan's grammar bitmask as (sample rows, int32 words [rows, ceil(V/32)]); None when
    no request of the step is structured (then the sampler does no extra work)."""
    if not request_ids:
        return None
    where = {rid: i for i, rid in enumerate(sampled_ids)}
    missing = [rid for rid in request_ids if rid not in where]
    if missing:
        raise ValueError(f"a grammar bitmask row for {missing[0]!r}, which samples no token here")
    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).view(len(request_ids), -1)
    return torch.tensor([where[rid] for rid in request_ids]), words


def apply_token_mask(logits: torch.Tensor, mask: tuple[torch.Tensor, torch.Tensor]) -> None:
    """In place: tokens the grammar forbids get -inf (bit j of word w allows token 32*w + j)."""
    rows, words = mask
    rows, words = to_device(rows, logits.device), to_device(words, logits.device)
    vocab = logits.shape[-1]
    if words.shape[-1] * 32 < vocab:
        raise ValueError(f"grammar bitmask covers {words.shape[-1] * 32} tokens, logits {vocab}")
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().view(len(rows), -1)[:, :vocab]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


class Sampler:
    def __init__(self, seed: int, batch_invariant: bool = False):
        # Unseeded requests share one stream, itself seeded for reproducible runs.
        self.generator = torch.Generator().manual_seed(seed)
        self.batch_invariant = batch_invariant

    def __call__(self, logits: torch.Tensor, specs: Sequence[SamplingSpec],
                 positions: Sequence[int],
                 histories: Optional[Sequence[Optional[TokenHistory]]] = None,
                 token_mask: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> SampleOutput:
        """logits [B, V] float32; ``positions[i]`` is the position the new token will take.

        ``histories``: None when no row uses penalties or bias (the common case, no work);
        else one per row, None for rows that use none. Penalised rows of ``logits`` are
        adjusted in place, after the raw rows that logprobs need were copied out.
        """
        return self.collect(self.to_host(*self.draw(logits, specs, positions, histories,
                                                    token_mask), specs), specs)

    def draw(self, logits: torch.Tensor, specs: Sequence[SamplingSpec], positions: Sequence[int],
             histories: Optional[Sequence[Optional[TokenHistory]]] = None,
             token_mask: Optional[tuple[torch.Tensor, torch.Tensor]] = None
             ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The device part of ``__call__``: (tokens [B] on the device, raw logprob rows)."""
        raw_rows = _raw_logprob_rows(logits, specs)
        if histories is not None:
            apply_penalties(logits, specs, histories)
        if token_mask is not None:  # grammar rows (structured_token_mask): after penalties and bias
            apply_token_mask(logits, token_mask)
        tokens = _argmax(logits)
        random_rows = [i for i, s in enumerate(specs) if not is_greedy(s)]
        if random_rows:
            uniforms = self._uniforms([specs[i] for i in random_rows],
                                      [positions[i] for i in random_rows])
            for group, at in _draw_groups(random_rows, specs, logits.shape[-1],
                                          self.batch_invariant):
                rows = to_device(group, logits.device)
                tokens[rows] = _draw(logits[rows], [specs[i] for i in group],
                                     to_device(uniforms[at], logits.device),
                                     probe=not self.batch_invariant)
        return tokens, raw_rows

    @staticmethod
    def to_host(tokens: torch.Tensor, raw_rows: Optional[torch.Tensor],
                specs: Sequence[SamplingSpec]) -> HostCopy:
        """Queue the copies of what ``collect`` returns, without waiting for them."""
        return HostCopy([tokens] + _logprob_tensors(raw_rows, tokens, specs))

    @staticmethod
    def collect(copy: HostCopy, specs: Sequence[SamplingSpec]) -> SampleOutput:
        """The host part: waits for the copies and builds tokens and logprobs."""
        tokens, *tables = copy.lists()
        return SampleOutput(tokens, logprob_lists(tables, specs))

    def _uniforms(self, specs: Sequence[SamplingSpec], positions: Sequence[int]) -> torch.Tensor:
        unseeded = [i for i, s in enumerate(specs) if s.seed is None]
        shared = torch.rand(len(unseeded), generator=self.generator, dtype=torch.float64).tolist()
        values = [seeded_uniform(s.seed, p) if s.seed is not None else 0.0
                  for s, p in zip(specs, positions)]
        for i, u in zip(unseeded, shared):
            values[i] = u
        return torch.tensor(values, dtype=torch.float32)


def _nucleus_lse(x: torch.Tensor, top_ps: list[float], probe: int) -> Optional[torch.Tensor]:
    """The rows' log-normalizers when, in every row, the ``probe`` most likely tokens already
    hold ``top_p`` of the mass (cutting there then gives exactly what the full sort would);
    None otherwise."""
    if probe >= x.shape[-1] or max(top_ps) >= 1.0:
        return None
    lse = x.logsumexp(dim=-1, keepdim=True)
    covered = (x.topk(probe, dim=-1).values - lse).exp().sum(dim=-1)
    return lse if bool((covered >= torch.tensor(top_ps, device=x.device)).all()) else None


def _draw_groups(rows: list[int], specs: Sequence[SamplingSpec], vocab: int,
                 batch_invariant: bool) -> list[tuple[list[int], torch.Tensor]]:
    """(rows, their places among ``rows``) drawn together. By default all of them: the
    top-k cut is the widest row's and the nucleus probe decides for all rows at once, so
    a row's rounding depends on the others. Batch-invariant: one group per top-k width
    and no probe; a lone row is paired with itself, since a one-row scan takes another
    kernel than a batch's (torch's cumsum)."""
    if not batch_invariant:
        return [(rows, torch.arange(len(rows)))]
    by_width: dict[int, list[int]] = {}
    for place, i in enumerate(rows):
        k = specs[i].top_k
        by_width.setdefault(k if 0 < k < vocab else vocab, []).append(place)
    groups = []
    for places in by_width.values():
        places = places * 2 if len(places) == 1 else places
        groups.append(([rows[p] for p in places], torch.tensor(places)))
    return groups


def _draw(logits: torch.Tensor, specs: Sequence[SamplingSpec], uniforms: torch.Tensor,
          probe: bool = True) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[-1]
    temps = to_device([s.temperature for s in specs], device)
    x = logits / temps[:, None]
    top_ks = [s.top_k if 0 < s.top_k < vocab else vocab for s in specs]
    top_ps = [s.top_p for s in specs]
    need_sorted = max(top_ks) < vocab or min(top_ps) < 1.0
    index = None
    if need_sorted:
        # topk is far cheaper than a full sort when every row caps k.
        width = max(top_ks)
        lse = _nucleus_lse(x, top_ps, NUCLEUS_PROBE) if probe and width == vocab else None
        if lse is not None:
            width = NUCLEUS_PROBE  # the top-p cut lies inside it: a full sort is not needed
        x, index = x.topk(width, dim=-1) if width < vocab else x.sort(dim=-1, descending=True)
        ranks = torch.arange(x.shape[-1], device=device)
        k = to_device(top_ks, device)
        x = x.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
        if min(top_ps) < 1.0:
            # top-p measures mass in the whole distribution (after any top-k cut)
            probs = x.softmax(dim=-1) if lse is None else (x - lse).exp()
            mass_before = probs.cumsum(dim=-1) - probs
            p = to_device(top_ps, device)
            drop = (mass_before >= p[:, None]) & (ranks[None, :] > 0)  # keep the best token
            x = x.masked_fill(drop, float("-inf"))
    probs = x.softmax(dim=-1)
    min_ps = [s.min_p for s in specs]
    if max(min_ps) > 0.0:
        floor = to_device(min_ps, device) * probs.max(dim=-1).values
        probs = probs.masked_fill(probs < floor[:, None], 0.0)
    cdf = probs.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1])[:, None]
    choice = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(1)
    # Guard against float edge cases landing on a zero-probability entry.
    choice = torch.where(probs.gather(1, choice[:, None]).squeeze(1) > 0, choice, probs.argmax(dim=-1))
    return choice if index is None else index.gather(1, choice[:, None]).squeeze(1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum. On the CPU numpy's (0.02 ms a row of 262k, against 0.22
    for torch's argmax or max: a batch-1 decode step pays it every token); CUDA keeps
    argmax, whose kernels its graphs captured."""
    if logits.is_cpu and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _raw_logprob_rows(logits: torch.Tensor,
                      specs: Sequence[SamplingSpec]) -> Optional[torch.Tensor]:
    """A copy of the raw rows whose request asked for logprobs (None if none did)."""
    asked = [i for i, s in enumerate(specs) if s.logprobs is not None]
    if not asked:
        return None
    return logits[to_device(asked, logits.device)]


def _logprob_tensors(raw_rows: Optional[torch.Tensor], tokens: torch.Tensor,
                     specs: Sequence[SamplingSpec]) -> list[torch.Tensor]:
    """[chosen, top values, top ids] on the device for the rows that asked ([] if none)."""
    if raw_rows is None:
        return []
    asked = [i for i, s in enumerate(specs) if s.logprobs is not None]
    rows = to_device(asked, raw_rows.device)
    logp = raw_rows.float().log_softmax(dim=-1)
    chosen = logp.gather(1, tokens[rows][:, None]).squeeze(1)
    k = min(max(specs[i].logprobs for i in asked), logp.shape[-1])
    top_vals, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
    return [chosen, top_vals, top_ids]


class HostCopy:
    """A step's tokens (and logprob tables) on their way to the host. On CUDA the copies
    are queued behind the sampling, so waiting for them does not wait for whatever the
    stream runs next (the following step's forward, when steps overlap)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.event = None
        if tensors and tensors[0].is_cuda:
            tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
                t, non_blocking=True) for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()
        self.tensors = tensors

    def lists(self) -> list[list]:
        if self.event is not None:
            self.event.synchronize()
        return [t.tolist() for t in self.tensors]

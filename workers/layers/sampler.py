"""Token sampling for the rows that reached the end of their known tokens.

Per row: greedy when temperature == 0 or top_k == 1; otherwise temperature,
then top-k, top-p and min-p (the order transformers applies them), then one
inverse-CDF draw. A seeded request's uniform number depends only on (seed,
position of the token being sampled), so its text does not depend on what else
is in the batch and survives preemption. Log probabilities come from the raw
logits, before any of these transforms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pocketllm.proto.messages import SamplingSpec, TokenLogprobs

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


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[Optional[TokenLogprobs]]


class Sampler:
    def __init__(self, seed: int):
        # Unseeded requests share one stream, itself seeded for reproducible runs.
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, specs: Sequence[SamplingSpec],
                 positions: Sequence[int]) -> SampleOutput:
        """logits [B, V] float32; ``positions[i]`` is the position the new token will take."""
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(specs) if not is_greedy(s)]
        if random_rows:
            uniforms = self._uniforms([specs[i] for i in random_rows],
                                      [positions[i] for i in random_rows])
            rows = torch.tensor(random_rows, device=logits.device)
            drawn = _draw(logits[rows], [specs[i] for i in random_rows], uniforms.to(logits.device))
            tokens[rows] = drawn
        token_ids = tokens.tolist()
        return SampleOutput(token_ids, _logprobs(logits, tokens, specs))

    def _uniforms(self, specs: Sequence[SamplingSpec], positions: Sequence[int]) -> torch.Tensor:
        unseeded = [i for i, s in enumerate(specs) if s.seed is None]
        shared = torch.rand(len(unseeded), generator=self.generator, dtype=torch.float64).tolist()
        values = [seeded_uniform(s.seed, p) if s.seed is not None else 0.0
                  for s, p in zip(specs, positions)]
        for i, u in zip(unseeded, shared):
            values[i] = u
        return torch.tensor(values, dtype=torch.float32)


def _draw(logits: torch.Tensor, specs: Sequence[SamplingSpec], uniforms: torch.Tensor) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([s.temperature for s in specs], device=device)
    x = logits / temps[:, None]
    top_ks = [s.top_k if 0 < s.top_k < vocab else vocab for s in specs]
    top_ps = [s.top_p for s in specs]
    need_sorted = max(top_ks) < vocab or min(top_ps) < 1.0
    index = None
    if need_sorted:
        # topk is far cheaper than a full sort when every row caps k.
        width = max(top_ks)
        x, index = x.topk(width, dim=-1) if width < vocab else x.sort(dim=-1, descending=True)
        ranks = torch.arange(x.shape[-1], device=device)
        k = torch.tensor(top_ks, device=device)
        x = x.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
        if min(top_ps) < 1.0:
            probs = x.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            p = torch.tensor(top_ps, device=device)
            drop = (mass_before >= p[:, None]) & (ranks[None, :] > 0)  # keep the best token
            x = x.masked_fill(drop, float("-inf"))
    probs = x.softmax(dim=-1)
    min_ps = [s.min_p for s in specs]
    if max(min_ps) > 0.0:
        floor = torch.tensor(min_ps, device=device) * probs.max(dim=-1).values
        probs = probs.masked_fill(probs < floor[:, None], 0.0)
    cdf = probs.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1])[:, None]
    choice = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(1)
    # Guard against float edge cases landing on a zero-probability entry.
    choice = torch.where(probs.gather(1, choice[:, None]).squeeze(1) > 0, choice, probs.argmax(dim=-1))
    return choice if index is None else index.gather(1, choice[:, None]).squeeze(1)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor,
              specs: Sequence[SamplingSpec]) -> list[Optional[TokenLogprobs]]:
    asked = [i for i, s in enumerate(specs) if s.logprobs is not None]
    out: list[Optional[TokenLogprobs]] = [None] * len(specs)
    if not asked:
        return out
    rows = torch.tensor(asked, device=logits.device)
    logp = logits[rows].float().log_softmax(dim=-1)
    chosen = logp.gather(1, tokens[rows][:, None]).squeeze(1).tolist()
    k = min(max(specs[i].logprobs for i in asked), logp.shape[-1])
    top_vals, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(asked):
        n = specs[i].logprobs
        out[i] = TokenLogprobs(chosen[j], top_ids[j][:n], top_vals[j][:n])
    return out

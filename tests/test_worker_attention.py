"""Paged attention (metadata + torch backend) against dense per-sequence attention."""

from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")

from pocketllm.workers.layers.attention import (ScheduledSeq, TorchAttention,  # noqa: E402
                                                build_metadata)

HEADS, KV_HEADS, DIM, BS, BLOCKS = 4, 2, 8, 4, 40


def dense_attention(q, k, v, q_pos, window, scale, softcap):
    """q [n, H, D] at positions q_pos; k/v [L, Hkv, D] for positions 0..L-1."""
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    kv_pos = torch.arange(k.shape[0])
    allowed = kv_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= kv_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(specs, window, softcap, seed=0):
    """specs: (context already cached, tokens this step) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    free = list(range(BLOCKS))
    random.Random(seed).shuffle(free)  # non-contiguous block tables
    k_cache = torch.full((BLOCKS * BS + BS, KV_HEADS, DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    k_cache[BLOCKS * BS:] = 0  # the zero padding block
    v_cache[BLOCKS * BS:] = 0
    seqs, full_k, full_v, qs, q_pos = [], [], [], [], []
    row = 0
    for cached, n in specs:
        total = cached + n
        blocks = [free.pop() for _ in range(math.ceil(total / BS))]
        k = torch.randn(total, KV_HEADS, DIM, generator=gen)
        v = torch.randn(total, KV_HEADS, DIM, generator=gen)
        for p in range(cached):  # what earlier steps wrote
            slot = blocks[p // BS] * BS + p % BS
            k_cache[slot], v_cache[slot] = k[p], v[p]
        seqs.append(ScheduledSeq(blocks, cached, n, row))
        full_k.append(k)
        full_v.append(v)
        qs.append(torch.randn(n, HEADS, DIM, generator=gen))
        q_pos.append(torch.arange(cached, total))
        row += n
    meta = build_metadata(seqs, BS, [window], torch.device("cpu"), pad_slot=BLOCKS * BS)
    q = torch.cat(qs)
    k_new = torch.cat([k[c:] for k, (c, _n) in zip(full_k, specs)])
    v_new = torch.cat([v[c:] for v, (c, _n) in zip(full_v, specs)])
    scale = 0.3
    out = TorchAttention().forward(q, k_new, v_new, k_cache, v_cache, meta, window, scale, softcap)
    expected = torch.cat([dense_attention(qi, ki, vi, pi, window, scale, softcap)
                          for qi, ki, vi, pi in zip(qs, full_k, full_v, q_pos)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_mixed_step_matches_dense(window, softcap):
    # fresh prefill, prefill chunk on a cached prefix, and decodes of different lengths
    run_case([(0, 7), (5, 6), (9, 1), (2, 1), (13, 1)], window, softcap)


@pytest.mark.parametrize("specs", [[(0, 11)], [(10, 1)], [(3, 1), (3, 1)], [(0, 2), (0, 9)]])
def test_single_group_layouts(specs):
    run_case(specs, window=4, softcap=None, seed=1)
    run_case(specs, window=None, softcap=None, seed=2)


def test_decode_rows_out_of_order_scatter_back():
    # decodes interleaved with prefills: their rows are not contiguous
    run_case([(4, 1), (0, 5), (6, 1), (3, 3), (1, 1)], window=None, softcap=None, seed=3)

"""Routed experts on the GPU: a grouped GEMM, one launch for every expert; and the
softmax top-k routing in one launch.

References: ``layers.moe.torch_experts`` and ``layers.moe.SoftmaxTopK``.

A step's T*k (token, expert) pairs are sorted by expert and each expert's group padded
to a multiple of BLOCK_M (``align``: one launch for a decode step's few pairs), so every
tile of BLOCK_M sorted rows belongs to one expert: a program reads its tile's expert and
multiplies the tile's rows by that expert's matrix. Padding slots hold the sentinel T*k and are masked off. The layout's
size depends on the token count alone (the worst case: every expert's group one row
past a tile), and tiles past the real end return at once, so nothing is read back to
the host and a step replays under CUDA graphs.

Launch 1 (gated): each pair's token row times its expert's gate and up columns, both
accumulated in the same program, ``act(gate) * up`` stored per pair [T*k, I]. Launch 2:
those rows times the expert's down matrix, scaled by the pair's routing weight
[T*k, H]. A token's k rows are then summed (a fixed order: no atomics).

gpt-oss's experts add a bias to each product (gate/up per expert [E, 2I], down [E, H],
added before the routing weight scales the row, as transformers does) and apply its
clamped SwiGLU (``layers.activation.ClampedSwiGLU``) in place of ``act(gate) * up``:
both are epilogues of the same two launches.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pocketllm.errors import UnsupportedFeatureError

from ..layers.activation import ClampedSwiGLU
from . import pdl
from .gated_act import KERNEL_ACTIVATIONS, activate
from .pdl import wait_for_prior

CLAMPED = "clamped_swiglu"  # the kernel's ACT for ClampedSwiGLU


@triton.jit
def gated_epilogue(gate, up, ACT: tl.constexpr, alpha, limit):
    """``act(gate) * up`` in float32, or gpt-oss's clamped SwiGLU (``ACT`` "clamped_swiglu")."""
    if ACT == "clamped_swiglu":
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
    return activate(gate, ACT) * up


def expert_activation(hidden_act) -> tuple[str, float, float]:
    """(the kernels' ACT, alpha, limit) of an HF activation name or a ``ClampedSwiGLU``."""
    if isinstance(hidden_act, ClampedSwiGLU):
        return CLAMPED, hidden_act.alpha, hidden_act.limit
    act = KERNEL_ACTIVATIONS.get(hidden_act)
    if act is None:
        raise UnsupportedFeatureError(f"activation {hidden_act!r} has no Triton kernel")
    return act, 0.0, 0.0


@triton.jit
def _moe_gemm(A, W, Out, SortedPairs, TileExpert, NumRows, Scale, Bias,
              num_pairs, n_out, k_in, a_div, w_half,
              stride_am, stride_we, stride_wn, stride_om, stride_be, alpha, limit,
              GATED: tl.constexpr, ACT: tl.constexpr, SCALE: tl.constexpr,
              HAS_BIAS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumRows):
        return  # past the last expert's group: the layout's spare tiles
    expert = tl.load(TileExpert + pid_m).to(tl.int64)
    pairs = tl.load(SortedPairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    a_rows = (pairs // a_div).to(tl.int64)  # gated: a pair reads its token's row
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = A + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptr = W + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_ok = offs_k + k0 < k_in
        a = tl.load(a_ptr, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = col_ok[None, :] & k_ok[:, None]
        acc = tl.dot(a, tl.load(w_ptr, mask=w_mask, other=0.0), acc, input_precision=PRECISION)
        if GATED:  # the up columns sit w_half rows below the gate columns
            w_up = tl.load(w_ptr + w_half * stride_wn, mask=w_mask, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    if HAS_BIAS:  # gated: the up bias sits w_half entries after the gate bias
        bias = Bias + expert * stride_be + cols
        acc += tl.load(bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias + w_half, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = gated_epilogue(acc, acc_up, ACT, alpha, limit)
    if SCALE:
        acc = acc * tl.load(Scale + pairs, mask=valid, other=0.0)[:, None]
    out = Out + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _softmax_topk(Logits, Weights, Ids, num_experts, stride_l,
                  TOP_K: tl.constexpr, K_BLOCK: tl.constexpr, BINS: tl.constexpr,
                  RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BINS)
    x = tl.load(Logits + row * stride_l + e, mask=e < num_experts, other=-float("inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    slot = tl.arange(0, K_BLOCK)
    weights = tl.zeros([K_BLOCK], tl.float32)
    ids = tl.zeros([K_BLOCK], tl.int32)
    for j in tl.static_range(TOP_K):  # k rounds of argmax (the lowest index among ties)
        best = tl.max(p, 0)
        pick = tl.min(tl.where(p == best, e, BINS), 0)
        weights = tl.where(slot == j, best, weights)
        ids = tl.where(slot == j, pick, ids)
        p = tl.where(e == pick, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)  # the unused slots hold 0
    tl.store(Weights + row * TOP_K + slot, weights, mask=slot < TOP_K)
    tl.store(Ids + row * TOP_K + slot, ids, mask=slot < TOP_K)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers.moe.softmax_topk`` in one launch: logits [T, E] -> (weights [T, k] float32,
    ids [T, k] int32)."""
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        _softmax_topk[(tokens,)](logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
                                 K_BLOCK=triton.next_power_of_2(top_k),
                                 BINS=triton.next_power_of_2(experts), RENORMALIZE=renormalize,
                                 num_warps=1 if experts <= 256 else 4,
                                 **pdl.launch_options(logits.device))
    return weights, ids


def capacity(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the aligned layout: each expert hit adds at most block_m - 1 padding rows."""
    rows = pairs + min(num_experts, pairs) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


@triton.jit
def _align_one_program(Ids, SortedPairs, TileExpert, NumRows, Offsets,
                       num_pairs, num_experts, rows, tiles,
                       BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, BINS: tl.constexpr,
                       FILL: tl.constexpr, TILE_CHUNK: tl.constexpr):
    """``align`` in one launch, for the few pairs of a decode step: the host-side version
    takes a dozen small launches, which per MoE layer would cost a batch-1 step more time
    than its expert products."""
    idx = tl.arange(0, PAIRS)
    valid = idx < num_pairs
    ids = tl.load(Ids + idx, mask=valid, other=num_experts).to(tl.int32)
    # (expert, pair) keys sorted: grouped by expert, pairs in order within a group
    keys = tl.sort(ids * PAIRS + idx)
    e = tl.arange(0, BINS)
    real = e < num_experts
    counts = tl.where(real, tl.histogram(ids, BINS), 0)  # the sentinel's bin dropped
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    # a pair's slot: its sorted position plus its expert's padding so far
    tl.store(Offsets + e, ends - padded - (tl.cumsum(counts, 0) - counts))
    tl.store(NumRows, tl.sum(padded, 0))
    for start in range(0, rows, FILL):
        r = start + tl.arange(0, FILL)
        tl.store(SortedPairs + r, tl.zeros([FILL], tl.int32) + num_pairs, mask=r < rows)
    for start in range(0, tiles, TILE_CHUNK):
        t = start + tl.arange(0, TILE_CHUNK)
        before = (ends[None, :] <= (t * BLOCK_M)[:, None]) & real[None, :]
        expert = tl.minimum(tl.sum(before.to(tl.int32), 1), num_experts - 1)
        tl.store(TileExpert + t, expert, mask=t < tiles)
    tl.debug_barrier()  # the offsets and the sentinel fill are written before the scatter
    expert = keys // PAIRS
    ok = expert < num_experts
    off = tl.load(Offsets + expert, mask=ok, other=0)
    tl.store(SortedPairs + idx + off, keys % PAIRS, mask=ok)


ONE_PROGRAM_PAIRS = 1024  # up to this many pairs align in one launch (the sort is one block)


def align(ids: torch.Tensor, num_experts: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_pairs int32 [R]: pair indices grouped by expert, each group
    padded to a multiple of block_m with the sentinel T*k; tile_expert int32 [R/block_m];
    num_rows int32 [1]: the padded rows in use). Device ops only (graph-capturable)."""
    pairs, device = ids.numel(), ids.device
    if pairs <= ONE_PROGRAM_PAIRS:
        rows = capacity(pairs, num_experts, block_m)
        sorted_pairs = torch.empty(rows, dtype=torch.int32, device=device)
        tile_expert = torch.empty(rows // block_m, dtype=torch.int32, device=device)
        num_rows = torch.empty(1, dtype=torch.int32, device=device)
        bins = triton.next_power_of_2(num_experts + 1)
        offsets = torch.empty(bins, dtype=torch.int32, device=device)
        _align_one_program[(1,)](
            ids.reshape(-1), sorted_pairs, tile_expert, num_rows, offsets,
            pairs, num_experts, rows, rows // block_m, BLOCK_M=block_m,
            PAIRS=max(16, triton.next_power_of_2(pairs)), BINS=bins, FILL=1024, TILE_CHUNK=32,
            num_warps=4)
        return sorted_pairs, tile_expert, num_rows
    return align_torch(ids, num_experts, block_m)


def align_torch(ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``align`` in torch ops, for steps of many pairs."""
    flat = ids.reshape(-1).to(torch.int64)
    pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # where each expert's pairs start, unpadded
    slot = (ends - padded)[expert] + torch.arange(pairs, device=device) - first[expert]
    rows = capacity(pairs, num_experts, block_m)
    sorted_pairs = torch.full((rows,), pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, slot, order.to(torch.int32))
    starts = torch.arange(0, rows, block_m, device=device)
    tile_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, tile_expert.to(torch.int32), ends[-1:].to(torch.int32)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def tiles(pairs: int, num_experts: int, n: int, k: int, dtype: torch.dtype
          ) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): tall tiles once experts get many rows (prefill), short
    ones for decode, where a tile holds one or two real rows and the weights dominate."""
    per_expert = pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    block_n = _pow2(n, 16, 64 if block_m == 64 else 32)
    block_k = _pow2(k, 16, 32 if dtype == torch.float32 else 128 if block_m <= 32 else 64)
    return block_m, block_n, block_k


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor, hidden_act,
                  b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None,
                  block: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """``torch_experts``' contract: x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; weights
    [T, k] float32; ids [T, k] -> [T, H]; ``hidden_act`` an HF name or ``ClampedSwiGLU``;
    biases ``b13`` [E, 2I], ``b2`` [E, H] or None. ``block``: (BLOCK_M, BLOCK_N, BLOCK_K)
    for both launches (default: ``tiles``)."""
    act, alpha, limit = expert_activation(hidden_act)
    for bias in (b13, b2):
        if bias is not None and not bias.is_contiguous():
            raise ValueError("expert biases must be contiguous")
    tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = ids.shape[1]
    pairs = tokens * top_k
    if tokens == 0:
        return torch.zeros_like(x)
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("expert weights must be contiguous")
    x = x.contiguous()
    weights = weights.to(torch.float32).contiguous()
    bm, bn1, bk1 = block or tiles(pairs, num_experts, inter, hidden, x.dtype)
    _, bn2, bk2 = block or tiles(pairs, num_experts, hidden, inter, x.dtype)
    sorted_pairs, tile_expert, num_rows = align(ids, num_experts, bm)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    inner = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    grid_m = tile_expert.numel()
    _moe_gemm[(grid_m, triton.cdiv(inter, bn1))](
        x, w13, inner, sorted_pairs, tile_expert, num_rows, weights,
        w13 if b13 is None else b13, pairs, inter, hidden, top_k, inter,
        x.stride(0), w13.stride(0), w13.stride(1), inner.stride(0),
        0 if b13 is None else b13.stride(0), alpha, limit,
        GATED=True, ACT=act, SCALE=False, HAS_BIAS=b13 is not None,
        BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=bk1,
        PRECISION=precision, num_warps=4)
    rows = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _moe_gemm[(grid_m, triton.cdiv(hidden, bn2))](
        inner, w2, rows, sorted_pairs, tile_expert, num_rows, weights,
        w2 if b2 is None else b2, pairs, hidden, inter, 1, 0,
        inner.stride(0), w2.stride(0), w2.stride(1), rows.stride(0),
        0 if b2 is None else b2.stride(0), 0.0, 0.0,
        GATED=False, ACT=act, SCALE=True, HAS_BIAS=b2 is not None,
        BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=bk2,
        PRECISION=precision, num_warps=4)
    return rows.view(tokens, top_k, hidden).sum(dim=1)


FIXED_TILE = (16, 32, 32)


def fused_experts_fixed_tile(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                             weights: torch.Tensor, ids: torch.Tensor, hidden_act,
                             b13: Optional[torch.Tensor] = None,
                             b2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The batch-invariant mode's: one tile whatever the batch, so a row's products are
    computed the same way in any step."""
    return fused_experts(x, w13, w2, weights, ids, hidden_act, b13, b2, block=FIXED_TILE)

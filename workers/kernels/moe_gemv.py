"""Routed experts for a step of a few tokens: matrix-vector products per (token, expert)
pair, and the down products summed per token in the same launch.

Reference: ``layers.moe.torch_experts`` (the grouped GEMM of ``fused_moe.py`` computes
the same contract for many tokens).

At batch-1 decode a token's k experts are k distinct matrices that nothing else in the
step reads, so the grouped GEMM's sort into block-aligned groups buys no reuse: its tiles
hold one real row of sixteen and its align launch and per-token sum are two more
launches per layer. Here, as in ``gemv.py``, each program owns ``BLOCK_N`` output
features of one matrix and walks the input row in ``BLOCK_K`` chunks, keeping float32
partial sums per (feature, column) that it reduces once:

- launch 1, per pair: ``act(x W_gate) * (x W_up)`` of the pair's token row and its
  expert's gate/up rows (plus gpt-oss's biases and clamped SwiGLU), stored per pair;
- launch 2, per token: its k pairs' rows times their experts' down rows at once (plus
  bias), each scaled by its routing weight and rounded to the model dtype as the
  grouped GEMM rounds it, summed in float32 and stored once. No atomics: a token's sum
  has a fixed order.

The grid depends on the token count alone and nothing is read back to the host, so a
step replays under CUDA graphs. The kernel policy picks this path for steps of at most
``KernelPolicy.MOE_GEMV_MAX_TOKENS`` tokens (measured, docs/gpu_kernels.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import pdl
from .fused_moe import expert_activation, gated_epilogue
from .pdl import wait_for_prior

# (BLOCK_N, BLOCK_K, num_warps) of each launch, timed on an H200 at Qwen3-30B-A3B's
# expert shapes (bench_moe.py --tune).
GATE_UP_CONFIG = (8, 128, 8)
DOWN_CONFIG = (2, 128, 4)


@triton.jit
def _gate_up_gemv(X, W, B, Ids, Out, top_k, inter, hidden, stride_xt, stride_we, stride_wn,
                  stride_be, stride_op, alpha, limit, ACT: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_prior(PDL)  # the expert ids come from the launch before
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < inter
    rows = tl.where(ok, rows, 0)  # padded rows reread row 0: no mask on the hot loads
    expert = tl.load(Ids + pair).to(tl.int64)
    x_row = X + (pair // top_k).to(tl.int64) * stride_xt
    ks = tl.arange(0, BLOCK_K)
    g_ptrs = W + expert * stride_we + rows.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    u_ptrs = g_ptrs + inter * stride_wn  # the up rows sit ``inter`` rows below the gate's
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = k0 + ks < hidden
        x = tl.load(x_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        wg = tl.load(g_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        wu = tl.load(u_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        acc_g += wg.to(tl.float32) * x[None, :]
        acc_u += wu.to(tl.float32) * x[None, :]
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    gate, up = tl.sum(acc_g, 1), tl.sum(acc_u, 1)
    if HAS_BIAS:
        bias = B + expert * stride_be + rows
        gate += tl.load(bias).to(tl.float32)
        up += tl.load(bias + inter).to(tl.float32)
    h = gated_epilogue(gate, up, ACT, alpha, limit)
    tl.store(Out + pair.to(tl.int64) * stride_op + rows, h.to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _down_gemv_sum(H, W, B, Ids, Weights, Out, top_k, hidden, inter, stride_hp, stride_we,
                   stride_wn, stride_be, stride_ot, HAS_BIAS: tl.constexpr,
                   TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr):
    wait_for_prior(PDL)
    # One program: BLOCK_N output features of one token, all its k experts at once (a
    # [TOP_K, BLOCK_N, BLOCK_K] tile per step: k matrices' loads in flight together).
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < hidden
    cols = tl.where(ok, cols, 0)
    js = tl.arange(0, TOP_K)
    j_ok = js < top_k  # TOP_K is top_k rounded up to a power of two
    pairs = token * top_k + tl.where(j_ok, js, 0)
    experts = tl.load(Ids + pairs).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = (W + experts[:, None, None] * stride_we
              + cols.to(tl.int64)[None, :, None] * stride_wn + ks[None, None, :])
    h_ptrs = H + pairs.to(tl.int64)[:, None] * stride_hp + ks[None, :]
    acc = tl.zeros([TOP_K, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = k0 + ks < inter
        h = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=k_ok[None, None, :], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * h[:, None, :]
        w_ptrs += BLOCK_K
        h_ptrs += BLOCK_K
    y = tl.sum(acc, 2)  # [TOP_K, BLOCK_N]: each pair's row
    if HAS_BIAS:
        y += tl.load(B + experts[:, None] * stride_be + cols[None, :]).to(tl.float32)
    # rounded as the grouped GEMM stores each scaled pair row, then summed in float32
    scale = tl.where(j_ok, tl.load(Weights + pairs), 0.0)
    y = (y * scale[:, None]).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + token.to(tl.int64) * stride_ot + cols, tl.sum(y, 0).to(Out.dtype.element_ty),
             mask=ok)


def gemv_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 weights: torch.Tensor, ids: torch.Tensor, hidden_act,
                 b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None
                 ) -> torch.Tensor:
    """``fused_moe.fused_experts``' contract, for a few tokens: x [T, H]; w13 [E, 2I, H];
    w2 [E, H, I]; weights [T, k] float32; ids [T, k] -> [T, H]."""
    act, alpha, limit = expert_activation(hidden_act)
    tokens, hidden = x.shape
    inter, top_k = w13.shape[1] // 2, ids.shape[1]
    if tokens == 0:
        return torch.zeros_like(x)
    for t in (w13, w2, b13, b2):
        if t is not None and not t.is_contiguous():
            raise ValueError("expert weights and biases must be contiguous")
    x = x.contiguous()
    ids = ids.to(torch.int32).contiguous()
    weights = weights.to(torch.float32).contiguous()
    inner = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    bn, bk, warps = GATE_UP_CONFIG
    bk = min(bk, triton.next_power_of_2(hidden))
    _gate_up_gemv[(tokens * top_k, triton.cdiv(inter, bn))](
        x, w13, w13 if b13 is None else b13, ids, inner, top_k, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), 0 if b13 is None else b13.stride(0),
        inner.stride(0), alpha, limit, ACT=act, HAS_BIAS=b13 is not None,
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **pdl.launch_options(x.device))
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    bn, bk, warps = DOWN_CONFIG
    bk = min(bk, triton.next_power_of_2(inter))
    _down_gemv_sum[(tokens, triton.cdiv(hidden, bn))](
        inner, w2, w2 if b2 is None else b2, ids, weights, out, top_k, hidden, inter,
        inner.stride(0), w2.stride(0), w2.stride(1), 0 if b2 is None else b2.stride(0),
        out.stride(0), HAS_BIAS=b2 is not None, TOP_K=triton.next_power_of_2(top_k),
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **pdl.launch_options(x.device))
    return out

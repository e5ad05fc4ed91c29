"""A matmul whose every output row is computed the same way whatever the number of rows.

Reference: ``F.linear``. The default path's products change their arithmetic with
the batch: a one-row step runs the gemv (plain FMAs in its own order), and cuBLAS
picks its kernel, split-K included, from the problem's shape. Here every output
element is one fp32 accumulation over K, in K order, of the same tensor-core
instruction (its k16 steps in sequence), with no split-K, whatever tile it lands in.
The tile is chosen by M, for speed: measured on an H200 (bf16, four Llama-3-8B
projections and a 1000 x 1000 one), all ten candidate tiles, this kernel's and
cuBLAS's no-split products gave bit-identical rows, because a tile's shape only
decides which elements one program computes, not how. tests/test_batch_invariant.py
checks rows at M across every tier below. Rows past M in the last tile re-read row 0
and are not stored.

The weight is the instruction's first operand (its 64/128-row side) and the tokens
the second, so a batch-1 step streams weights through wide tiles of few tokens.
Used by the batch-invariant mode only (``workers/kernel_policy.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _matmul_kernel(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    # Y^T tile [BLOCK_W weight rows, BLOCK_T tokens] = W tile @ X tile^T.
    rn = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    rm = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    m_ok, n_ok = rm < M, rn < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + tl.where(m_ok, rm, 0).to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = W + tl.where(n_ok, rn, 0).to(tl.int64)[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros([BLOCK_W, BLOCK_T], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k0 + ks) < K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(Bias + tl.where(n_ok, rn, 0)).to(tl.float32)[:, None]
    out = Y + rm.to(tl.int64)[None, :] * stride_ym + rn[:, None]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


# (BLOCK_W weight rows, BLOCK_T tokens, BLOCK_K, warps, stages) by the largest M of each
# tier, timed on an H200 over the Llama-3-8B projections (docs/benchmarks.md).
TIERS = ((32, (64, 16, 128, 4, 5)), (64, (128, 32, 64, 4, 4)), (256, (128, 64, 64, 4, 4)),
         (1 << 62, (128, 128, 64, 4, 3)))
FLOAT32_CONFIG = (64, 16, 32, 4, 2)  # float32 operands (exact FMAs): small tiles fit


def _config(m: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    if dtype == torch.float32:
        return FLOAT32_CONFIG
    return next(config for most, config in TIERS if m <= most)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           out_dtype: Optional[torch.dtype] = None,
           config: Optional[tuple[int, int, int, int, int]] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K] and weight [N, K], in ``out_dtype``
    (default x's), each row computed as it would be in any other M."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear of {tuple(x.shape)} by a weight of {tuple(weight.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("the weight's rows must be contiguous")
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    if m == 0:
        return y
    block_w, block_t, block_k, warps, stages = config or _config(m, x.dtype)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    grid = (triton.cdiv(m, block_t), triton.cdiv(n, block_w))
    _matmul_kernel[grid](x, weight, bias if bias is not None else weight, y, m, n, k,
                         x.stride(0), weight.stride(0), y.stride(0),
                         BLOCK_W=block_w, BLOCK_T=block_t, BLOCK_K=block_k,
                         HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
                         PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                         num_warps=warps, num_stages=stages)
    return y

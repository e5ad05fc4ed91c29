"""A matmul whose every output row is computed the same way whatever the number of rows.

Reference: ``F.linear``. cuBLAS picks its kernel (tile shape, split-K) from the
problem's shape, and the gemv of one-row steps is another kernel again, so the
same row of activations gives different roundings in a step of 1 row and one of
300: a request's logits then depend on what else shares its steps. Here the
launch shape depends on the weight alone (N, K), never on M: each output element
is one fp32 accumulation over K in BLOCK_K chunks, in the same order, by the same
tensor-core instruction, in whatever row of whatever tile it lands. Rows past M
in the last tile re-read row 0 and are not stored. No split-K, no autotuning.

Used by the batch-invariant mode only (``workers/kernel_policy.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _matmul_kernel(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok, n_ok = rm < M, rn < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + tl.where(m_ok, rm, 0).to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = W + tl.where(n_ok, rn, 0).to(tl.int64)[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k0 + ks) < K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(Bias + tl.where(n_ok, rn, 0)).to(tl.float32)[None, :]
    out = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): one shape for every M. BLOCK_N is narrow so
# that a batch-1 step still spreads a projection over many programs (it streams weights).
CONFIG = (64, 32, 128, 4, 4)
FLOAT32_CONFIG = (64, 32, 32, 4, 2)  # float32 operands: a smaller K chunk fits


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           out_dtype: Optional[torch.dtype] = None,
           config: Optional[tuple[int, int, int, int, int]] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K] and weight [N, K], in ``out_dtype``
    (default x's), computed per row independently of M."""
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
    fp32 = x.dtype == torch.float32
    block_m, block_n, block_k, warps, stages = config or (FLOAT32_CONFIG if fp32 else CONFIG)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _matmul_kernel[grid](x, weight, bias if bias is not None else weight, y, m, n, k,
                         x.stride(0), weight.stride(0), y.stride(0),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
                         PRECISION="ieee" if fp32 else "tf32",
                         num_warps=warps, num_stages=stages)
    return y

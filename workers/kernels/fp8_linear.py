"""Products with FP8 (e4m3) weights of one scale per output row, on FP8 tensor cores.

A weight is ``q`` float8_e4m3fn [N, K] with ``scale`` float32 [N]: w = q * scale[:, None].
One row (a batch-1 decode step) runs the fused gemv of ``gemv.py`` (it reads the FP8 row
and applies the scale to its sum). More rows quantize each activation row to e4m3 with
its own scale (``quantize_rows``: amax / 448, one launch) and multiply on the tensor
cores with both scales applied in the GEMM's epilogue (``torch._scaled_mm``, row-wise).
Row-wise scales on both sides make every output element
sum(qx * qw) * sx[row] * sw[col]: exact in the scales, the only error e4m3's rounding
of each activation and weight.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
# A row of zeros gets this scale (not 0: the quotient would be NaN)
MIN_SCALE = 1e-12


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, stride_x, stride_q, BLOCK: tl.constexpr):
    """One program per row: its amax, then the row divided by amax / 448, cast."""
    m = tl.program_id(0)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(X + m * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(X + m * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(Q + m * stride_q + cols, q.to(Q.dtype.element_ty), mask=cols < K)
    tl.store(S + m, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]), one scale per row. Off CUDA the
    torch ops (``quantize_weight``'s): Triton's CPU interpreter rounds e4m3 stores wrongly
    (-126.7 -> -64 under Triton 3.9)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quantize_rows takes rows with contiguous columns, got {tuple(x.shape)}")
    if not x.is_cuda:
        q, s = quantize_weight(x)
        return q, s[:, None]
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0),
                                    BLOCK=min(triton.next_power_of_2(k), 2048), num_warps=4)
    return q, s


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float matrix [N, K] -> (e4m3 [N, K], float32 [N]): each row scaled so its largest
    magnitude is e4m3's largest, 448 (at load; torch ops on any device)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp_(min=MIN_SCALE)
    q = (w / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  bias: Optional[torch.Tensor] = None,
                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x [M, K] (bfloat16 or float16) @ (weight * scale[:, None]).T (+ bias) -> [M, N]."""
    xq, xs = quantize_rows(x if x.stride(-1) == 1 else x.contiguous())
    # The GEMM's row-wise epilogue writes bfloat16; a float32 output (an LM head) is cast.
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1),
                         out_dtype=torch.bfloat16)
    if bias is not None:
        y = y + bias
    out_dtype = out_dtype or x.dtype
    return y if y.dtype == out_dtype else y.to(out_dtype)

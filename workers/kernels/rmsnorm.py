"""RMSNorm, optionally fused with the residual add before it.

Reference: ``layers.norm.RMSNorm`` (float32 math, float32 weight, result cast to
the input dtype) applied to ``x + residual`` computed in the model dtype, as the
decoder layers do (``x = x + attn; h = norm(x)``). The fused kernel reads x and
the residual once and writes both the new residual and the normed rows: one
pass instead of three. Gemma's ``(1 + w)`` is already folded into ``weight``.

``rms_norm_int8``: the same launch writes the normed rows as the int8 blocks of 32 that
a GGUF layer's integer dots read (``int8_blocks.py``), in place of the rows themselves:
the norm and the activations' rounding as one launch before q/k/v or gate/up.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .fixed_sum import lane_sum
from .int8_blocks import store_int8_blocks


@triton.jit
def _rmsnorm_kernel(X, Res, W, Out, ResOut, Q, QD, QS, inner, stride_x0, stride_x1, stride_r,
                    stride_o, eps, DIM: tl.constexpr, BLOCK: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr):
    row = tl.program_id(0)
    # Row ``row`` of a [outer, inner, DIM] view (inner = 1 for a 2-D input).
    x_off = (row // inner).to(tl.int64) * stride_x0 + (row % inner) * stride_x1
    cols = tl.arange(0, BLOCK)
    ok = cols < DIM
    x = tl.load(X + x_off + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Res + row.to(tl.int64) * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # rounded as torch does
        tl.store(ResOut + row.to(tl.int64) * stride_o + cols, x, mask=ok)
    xf = x.to(tl.float32)
    # the squares summed as the fused norm_gemv sums them (fixed_sum.py): the same bits
    inv_rms = 1.0 / tl.sqrt(tl.sum(lane_sum((xf * xf)[None, :], 1, BLOCK), 0) / DIM + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    h = (xf * inv_rms * w).to(X.dtype.element_ty)  # Out's dtype is x's
    if QUANTIZE:  # the normed row as int8 blocks (DIM a multiple of 32) in place of itself
        store_int8_blocks(tl.reshape(h.to(tl.float32), [BLOCK // 32, 32]),
                          tl.arange(0, BLOCK // 32), row, DIM, Q, QD, QS, BLOCK // 32)
    else:
        tl.store(Out + row.to(tl.int64) * stride_o + cols, h, mask=ok)


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rmsnorm(x) * weight``. x: [N, dim], or [N, heads, dim] such as per-head q/k
    taken from a fused projection (any outer strides). The result is contiguous."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual) * weight, x + residual)``, the sum rounded to x's dtype
    before the norm, as the unfused layers compute it. Both results are contiguous."""
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    out, res_out = _launch(x, residual, weight, eps)
    return out, res_out


def rms_norm_int8(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                  eps: float) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                                       Optional[torch.Tensor]]:
    """``gguf_dot.quantize_rows`` of ``rms_norm(x)`` (residual None) or of
    ``add_rms_norm(x, residual)``'s normed rows, with the same bits, in one launch: the
    normed rows are rounded to int8 blocks where they are computed and never written. ->
    (codes, scales, sums), and x + residual (None without a residual). x [M, K], K a
    multiple of 32."""
    if x.dim() != 2 or x.shape[-1] % 32:
        raise ValueError(f"rms_norm_int8 takes [M, K] rows, K a multiple of 32, got "
                         f"{tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    d = torch.empty(m, k // 32, dtype=torch.float32, device=x.device)
    s = torch.empty_like(d)
    res_out = _launch(x, residual, weight, eps, (q, d, s))[1]
    return (q, d, s), res_out


def _launch(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
            eps: float, blocks: Optional[tuple] = None
            ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``blocks``: (codes, scales, sums) that receive the normed rows as int8 blocks in
    place of the normed rows themselves (the first result is then None)."""
    dim, shape = x.shape[-1], x.shape
    if x.stride(-1) != 1 or x.dim() not in (2, 3):
        x = x.reshape(-1, dim).contiguous()
    outer, inner = (x.shape[0], 1) if x.dim() == 2 else (x.shape[0], x.shape[1])
    rows = outer * inner
    out = torch.empty(shape, device=x.device, dtype=x.dtype) if blocks is None else None
    res_out = None
    if residual is not None:
        residual = residual.reshape(rows, dim)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        res_out = torch.empty(shape, device=x.device, dtype=x.dtype)
    if rows:
        block = triton.next_power_of_2(dim)
        q, qd, qs = blocks if blocks is not None else (x, x, x)  # unused without blocks
        _rmsnorm_kernel[(rows,)](
            x, residual if residual is not None else x, weight,
            out if out is not None else x, res_out if res_out is not None else x, q, qd, qs,
            inner, x.stride(0), x.stride(1) if x.dim() == 3 else 0,
            residual.stride(0) if residual is not None else 0, dim, eps,
            DIM=dim, BLOCK=block, HAS_RESIDUAL=residual is not None,
            QUANTIZE=blocks is not None, num_warps=_warps(block))
    return out, res_out

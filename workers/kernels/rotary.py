"""Rotary embedding of q and k in one launch, in place.

Reference: ``layers.rotary.apply_rotary`` -- the neox / HF "rotate half" layout:
the first and second halves of the head dimension are the pair rotated by
``(cos, sin)`` of the token's position. cos/sin come from ``RotaryTable.lookup``
(already scaled, one row per token). The kernel rotates in float32 and rounds
once (the reference rounds after each multiply in the model dtype). With ``norms``,
each head is first RMS-normed (``layers.norm.RMSNorm``), so that a q/k norm and the
rotary are one launch. A partial rotary rotates the head's first dimensions only.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import wait_for_prior


@triton.jit
def _rotate(X, W, token, stride_t, stride_h, heads, cos, sin, eps,
            BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
            REST: tl.constexpr, BLOCK_REST: tl.constexpr, NORM: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < heads) & (d < HALF)
    ptr = X + token.to(tl.int64) * stride_t + h * stride_h + d
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # each head's RMSNorm first, rounded to the model dtype as rms_norm leaves it
        squares = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        if REST > 0:  # a partial rotary: the rest of the head is normed, not rotated
            r = tl.arange(0, BLOCK_REST)[None, :]
            rest_mask = (h < heads) & (r < REST)
            rest_ptr = X + token.to(tl.int64) * stride_t + h * stride_h + 2 * HALF + r
            x3 = tl.load(rest_ptr, mask=rest_mask, other=0.0).to(tl.float32)
            squares += tl.sum(x3 * x3, 1)
        inv_rms = 1.0 / tl.sqrt(squares / (2 * HALF + REST) + eps)
        w1 = tl.load(W + d, mask=d < HALF, other=0.0)
        w2 = tl.load(W + HALF + d, mask=d < HALF, other=0.0)
        x1 = (x1 * inv_rms[:, None] * w1).to(X.dtype.element_ty).to(tl.float32)
        x2 = (x2 * inv_rms[:, None] * w2).to(X.dtype.element_ty).to(tl.float32)
        if REST > 0:
            w3 = tl.load(W + 2 * HALF + r, mask=r < REST, other=0.0)
            tl.store(rest_ptr, (x3 * inv_rms[:, None] * w3).to(X.dtype.element_ty),
                     mask=rest_mask)
    tl.store(ptr, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
    tl.store(ptr + HALF, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(Q, K, Cos, Sin, QW, KW, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_ct, stride_st, q_heads, eps, HALF: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr,
                   NORM: tl.constexpr, PDL: tl.constexpr):
    # one program per (token, head): a decode step's one token still spreads over the SMs
    wait_for_prior(PDL)
    token, head = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(Cos + token.to(tl.int64) * stride_ct + d, mask=d < HALF, other=0.0)
    sin = tl.load(Sin + token.to(tl.int64) * stride_st + d, mask=d < HALF, other=0.0)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    if head < q_heads:
        _rotate(Q + head * stride_qh, QW, token, stride_qt, stride_qh, 1, cos, sin, eps, 1,
                HALF, BLOCK_HALF, REST, BLOCK_REST, NORM)
    else:
        _rotate(K + (head - q_heads) * stride_kh, KW, token, stride_kt, stride_kh, 1, cos, sin,
                eps, 1, HALF, BLOCK_HALF, REST, BLOCK_REST, NORM)


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    norms: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place (views of a fused qkv output are
    fine: any token/head strides, unit stride along D); cos/sin: [T, R/2] or [T, 1, R/2]
    as ``RotaryTable.lookup`` returns, R <= D the rotated width (a partial rotary, R < D,
    passes each head's last D - R dimensions through). ``norms`` = (q weight [D], k weight
    [D], eps): each whole head is RMS-normed first (Qwen3's, Gemma 3's and Qwen3.5's q/k
    norms, as ``norm.rms_norm`` computes them), in the same launch. Returns (q, k)."""
    tokens, q_heads, dim = q.shape
    half = cos.shape[-1]
    if 2 * half > dim or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"rotary of {2 * half} dimensions needs a head_dim of at least that "
                         f"({dim}) with unit stride")
    cos, sin = cos.reshape(tokens, half), sin.reshape(tokens, half)
    if tokens == 0:
        return q, k
    rest = dim - 2 * half
    q_w, k_w, eps = norms if norms is not None else (cos, cos, 0.0)
    if norms is not None and (q_w.shape != (dim,) or k_w.shape != (dim,)):
        raise ValueError(f"q/k norm weights must be [{dim}]")
    _rotary_kernel[(tokens, q_heads + k.shape[1])](
        q, k, cos, sin, q_w, k_w, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), q_heads, eps,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        REST=rest, BLOCK_REST=triton.next_power_of_2(rest) if rest else 1,
        NORM=norms is not None, num_warps=2 if dim >= 256 else 1,
        **pdl.launch_options(q.device))
    return q, k

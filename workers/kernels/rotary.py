"""Rotary embedding of q and k in one launch, in place.

Reference: ``layers.rotary.apply_rotary`` -- the neox / HF "rotate half" layout:
the first and second halves of the head dimension are the pair rotated by
``(cos, sin)`` of the token's position. cos/sin come from ``RotaryTable.lookup``
(already scaled, one row per token). The kernel rotates in float32 and rounds
once (the reference rounds after each multiply in the model dtype). With ``norms``,
each head is first RMS-normed (``layers.norm.RMSNorm``), so that a q/k norm and the
rotary are one launch.
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
            NORM: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < heads) & (d < HALF)
    ptr = X + token.to(tl.int64) * stride_t + h * stride_h + d
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # each head's RMSNorm first, rounded to the model dtype as rms_norm leaves it
        inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        w1 = tl.load(W + d, mask=d < HALF, other=0.0)
        w2 = tl.load(W + HALF + d, mask=d < HALF, other=0.0)
        x1 = (x1 * inv_rms[:, None] * w1).to(X.dtype.element_ty).to(tl.float32)
        x2 = (x2 * inv_rms[:, None] * w2).to(X.dtype.element_ty).to(tl.float32)
    tl.store(ptr, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
    tl.store(ptr + HALF, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(Q, K, Cos, Sin, QW, KW, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_ct, stride_st, q_heads, k_heads, eps, HALF: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   NORM: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior(PDL)
    token = tl.program_id(0)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(Cos + token.to(tl.int64) * stride_ct + d, mask=d < HALF, other=0.0)
    sin = tl.load(Sin + token.to(tl.int64) * stride_st + d, mask=d < HALF, other=0.0)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    _rotate(Q, QW, token, stride_qt, stride_qh, q_heads, cos, sin, eps, BLOCK_HQ, HALF,
            BLOCK_HALF, NORM)
    _rotate(K, KW, token, stride_kt, stride_kh, k_heads, cos, sin, eps, BLOCK_HK, HALF,
            BLOCK_HALF, NORM)


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    norms: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place (views of a fused qkv output are
    fine: any token/head strides, unit stride along D); cos/sin: [T, D/2] or
    [T, 1, D/2] as ``RotaryTable.lookup`` returns. ``norms`` = (q weight [D], k weight
    [D], eps): each head is RMS-normed first (Qwen3's and Gemma 3's q/k norms, as
    ``norm.rms_norm`` computes them), in the same launch. Returns (q, k)."""
    tokens, q_heads, dim = q.shape
    if dim % 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary needs an even head_dim with unit stride")
    cos, sin = cos.reshape(tokens, dim // 2), sin.reshape(tokens, dim // 2)
    if tokens == 0:
        return q, k
    half = dim // 2
    q_w, k_w, eps = norms if norms is not None else (cos, cos, 0.0)
    if norms is not None and (q_w.shape != (dim,) or k_w.shape != (dim,)):
        raise ValueError(f"q/k norm weights must be [{dim}]")
    _rotary_kernel[(tokens,)](
        q, k, cos, sin, q_w, k_w, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), q_heads, k.shape[1], eps,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(q_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        NORM=norms is not None, num_warps=4 if q_heads * half >= 1024 else 1,
        **pdl.launch_options(q.device))
    return q, k

"""A Gated DeltaNet decode step in two launches (``layers/linear_attention.py``'s decode
path on CUDA), where the torch forms take some thirty small ones per layer:

1. ``_conv_kernel``: each sequence's causal convolution over its new q/k/v row, SiLU after,
   its conv state (found by its slot) shifted in place;
2. ``_delta_norm_kernel``: per sequence and value head, the decay and write strength from
   a and b, q/k L2-normalised, the delta-rule update of the head's [k_dim, v_dim] state
   (in place, by slot, float32), its output, and the gated RMSNorm of that output.

References: ``gated_delta.conv_step``, ``decay_and_beta``, ``decode_step`` and
``gated_rms_norm``; this rounds to the model dtype where they do (the output before the
norm, the normed row before the weight and after it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_kernel(X, stride_x, W, States, Slots, Y, C, K: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    ok = ch < C
    slot = tl.load(Slots + b).to(tl.int64)
    x = tl.load(X + b.to(tl.int64) * stride_x + ch, mask=ok, other=0.0)
    acc = x.to(tl.float32) * tl.load(W + ch * K + (K - 1), mask=ok, other=0.0).to(tl.float32)
    state = States + slot * C * (K - 1) + ch * (K - 1)
    for j in tl.static_range(K - 1):
        acc += (tl.load(state + j, mask=ok, other=0.0).to(tl.float32)
                * tl.load(W + ch * K + j, mask=ok, other=0.0).to(tl.float32))
    for j in tl.static_range(K - 2):  # oldest first: each reads a tap not yet overwritten
        tl.store(state + j, tl.load(state + j + 1, mask=ok), mask=ok)
    tl.store(state + (K - 2), x.to(States.dtype.element_ty), mask=ok)
    tl.store(Y + b.to(tl.int64) * C + ch, (acc / (1.0 + tl.exp(-acc))).to(Y.dtype.element_ty),
             mask=ok)


@triton.jit
def _delta_norm_kernel(Y, Proj, stride_proj, z_at, b_at, a_at, ALog, DtBias, NormW, States,
                       Slots, Out, scale, eps_norm,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (HV // HK)
    slot = tl.load(Slots + b).to(tl.int64)
    ok, ov = tl.arange(0, DK), tl.arange(0, DV)
    row = Y + b.to(tl.int64) * (2 * HK * DK + HV * DV)
    q = tl.load(row + kh * DK + ok).to(tl.float32)
    k = tl.load(row + HK * DK + kh * DK + ok).to(tl.float32)
    v = tl.load(row + 2 * HK * DK + h * DV + ov).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale  # gated_delta.L2_EPS
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    proj = Proj + b.to(tl.int64) * stride_proj
    x = tl.load(proj + a_at + h).to(tl.float32) + tl.load(DtBias + h)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold
    g = -tl.exp(tl.load(ALog + h)) * softplus
    beta = 1.0 / (1.0 + tl.exp(-tl.load(proj + b_at + h).to(tl.float32)))
    at = States + (slot * HV + h) * DK * DV + ok[:, None] * DV + ov[None, :]
    s = tl.load(at) * tl.exp(g)
    u = beta * (v - tl.sum(s * k[:, None], 0))
    s += k[:, None] * u[None, :]
    tl.store(at, s)
    o = tl.sum(s * q[:, None], 0).to(Out.dtype.element_ty).to(tl.float32)
    normed = (o * tl.rsqrt(tl.sum(o * o, 0) / DV + eps_norm)).to(Out.dtype.element_ty)
    scaled = (tl.load(NormW + ov).to(tl.float32) * normed.to(tl.float32))
    scaled = scaled.to(Out.dtype.element_ty).to(tl.float32)
    z = tl.load(proj + z_at + h * DV + ov).to(tl.float32)
    tl.store(Out + b.to(tl.int64) * HV * DV + h * DV + ov,
             (scaled * z / (1.0 + tl.exp(-z))).to(Out.dtype.element_ty))


def decode(proj: torch.Tensor, widths: list[int], conv_weight: torch.Tensor,
           conv_states: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
           a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
           k_heads: int, k_dim: int, eps: float) -> torch.Tensor:
    """One token of each of B sequences: ``proj`` [B, sum(widths)] is the stacked input
    projection (q, k, v | z | b | a) -> the gated, normed outputs [B, v_heads * v_dim].
    The slots' conv states [S, C, kernel - 1] and states [S, v_heads, k_dim, v_dim] are
    updated in place."""
    channels, value, v_heads, _ = widths
    v_dim = value // v_heads
    batch = proj.shape[0]
    if proj.stride(-1) != 1:
        proj = proj.contiguous()
    taps = conv_weight.shape[1]
    y = torch.empty(batch, channels, device=proj.device, dtype=proj.dtype)
    block = 256
    _conv_kernel[(batch, triton.cdiv(channels, block))](
        proj, proj.stride(0), conv_weight, conv_states, slots, y, channels, taps, block)
    out = torch.empty(batch, value, device=proj.device, dtype=proj.dtype)
    _delta_norm_kernel[(batch, v_heads)](
        y, proj, proj.stride(0), channels, channels + value, channels + value + v_heads,
        a_log, dt_bias, norm_weight, states, slots, out, k_dim ** -0.5, eps,
        k_heads, v_heads, k_dim, v_dim, num_warps=8 if k_dim * v_dim >= 128 * 64 else 4)
    return out

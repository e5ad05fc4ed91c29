"""Activation rows rounded to int8 in blocks of 32, as the GGUF integer dots read them
(``gguf_dot.py``): int8 codes, a float32 scale per block (amax / 127) and the block's
float32 sum.

One ``@triton.jit`` helper does the rounding for every kernel that writes such blocks:
``gguf_dot.quantize_rows`` (its own launch), and the RMSNorm (``rmsnorm.py``) and gated
activation (``gated_act.py``) kernels that write x's blocks in place of x itself, so that
a GGUF layer's product skips the rounding's launch. The same code in each gives the same
bits; the block sum is a ``lane_sum`` (a fixed order of adds, whatever the launch's
layout), so it too is the same in every kernel. Compiled, a value computed in registers
(the norm's x * rstd * w, act * up) would have its product fused into the sum's first add
(an FMA), other bits than the stored value gives: ``_as_stored`` makes it opaque first.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .fixed_sum import lane_sum

# The interpreter fuses no multiply into an add, and runs no assembly.
_PIN: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _as_stored(x):
    """x float32 as the compiler must take it from a register move: no FMA reaches
    across, so a sum of x has the bits of the same sum of x read from memory."""
    if _PIN:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    return x


@triton.jit
def store_int8_blocks(x, blk, row, K, Q, D, S, NB: tl.constexpr):
    """Round blocks ``blk`` ([NB] block indices; those past ``K // 32`` are left out) of
    row ``row`` of an [M, K] activation, x float32 [NB, 32] (the values as the model
    dtype holds them), and store them: codes to int8 Q [M, K], scales and sums to
    float32 D and S [M, K / 32]."""
    x = _as_stored(x)
    d = tl.max(tl.abs(x), 1) / 127.0
    inv = tl.where(d > 0, 1.0 / d, 0.0)
    q = (x * inv[:, None] + 12582912.0) - 12582912.0  # 1.5 * 2^23: rounds to nearest even
    ok = blk < K // 32
    row = row.to(tl.int64)
    cols = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(Q + row * K + cols, q.to(tl.int8), mask=ok[:, None])
    tl.store(D + row * (K // 32) + blk, d, mask=ok)
    tl.store(S + row * (K // 32) + blk, lane_sum(x, NB, 32), mask=ok)

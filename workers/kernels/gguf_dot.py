"""Batch-1 products with GGUF block matrices on 8-bit activations and integer dots.

The float block gemvs (``gguf_gemv.py``) turn every 4-bit weight into a float and
multiply-add it: some five instructions a weight, so they run at a third to a half of
the memory's speed. Here, as llama.cpp's MMVQ does, the activation row is first rounded
to int8 in blocks of 32 (``quantize_rows``: a float32 scale and the block's float sum
each), and the weights stay integers: one ``dp4a`` instruction multiplies four 8-bit
weights by four 8-bit activations and adds the four products, so a 32-bit word of Q4_K
nibbles (eight weights) costs two masks, one shift and two ``dp4a``. Each sub-block's
integer dot is scaled once:

    sum_i w_i x_i = d * sc * dx * sum_i q_i qx_i - dmin * m * sum_i x_i

(Q4_K: w = d * sc * q - dmin * m per sub-block of 32; dx the activation block's scale).
The only new error is the activations' rounding to 8 bits (relative ~2^-8 per block).

Under Triton's CPU interpreter (no inline assembly) ``dp4a`` is four multiply-adds of
the bytes, the same integers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .gguf_gemv import Q4_K, _check

EMULATE = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dp4a(a, b, c, EMULATE: tl.constexpr):
    """c + the sum of a's four unsigned bytes times b's four signed bytes (int32 each)."""
    if EMULATE:
        acc = c
        for i in tl.static_range(4):
            acc += ((a >> (8 * i)) & 255) * ((b << (24 - 8 * i)) >> 24)
        return acc
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [a, b, c], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _quantize_kernel(X, Q, D, S, K, stride_x, BLOCKS: tl.constexpr):
    """Program (row, BLOCKS blocks of 32): each block's amax / 127, its int8 codes
    (rounded to nearest even) and its float sum."""
    m, b0 = tl.program_id(0), tl.program_id(1) * BLOCKS
    blk = b0 + tl.arange(0, BLOCKS)
    ok = blk < K // 32
    cols = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(X + m * stride_x + cols, mask=ok[:, None], other=0.0).to(tl.float32)
    d = tl.max(tl.abs(x), 1) / 127.0
    inv = tl.where(d > 0, 1.0 / d, 0.0)
    q = (x * inv[:, None] + 12582912.0) - 12582912.0  # 1.5 * 2^23: rounds to an integer
    tl.store(Q + m * K + cols, q.to(tl.int8), mask=ok[:, None])
    tl.store(D + m * (K // 32) + blk, d, mask=ok)
    tl.store(S + m * (K // 32) + blk, tl.sum(x, 1), mask=ok)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) -> (int8 codes [M, K], float32 scales [M, K/32],
    float32 block sums [M, K/32])."""
    m, k = x.shape
    if k % 32 or x.stride(-1) != 1:
        raise ValueError(f"quantize_rows takes rows of a multiple of 32 contiguous values, "
                         f"got {tuple(x.shape)}")
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    d = torch.empty(m, k // 32, dtype=torch.float32, device=x.device)
    s = torch.empty_like(d)
    blocks = 16
    _quantize_kernel[(m, triton.cdiv(k // 32, blocks))](x, q, d, s, k, x.stride(0),
                                                       BLOCKS=blocks, num_warps=1)
    return q, d, s


@triton.jit
def _k4_scales(w1, w2, w3, h: tl.constexpr):
    """Sub-blocks 2r + h's (r = 0..3) 6-bit scales and mins from a super-block's words
    1-3 (bytes 4-15; w [BN, SB, 1]) -> float32 [BN, SB, 4] each: sub-block s < 4 is the
    low six bits of bytes 4 + s and 8 + s; s >= 4 a nibble of byte 8 + s topped by the
    two high bits of bytes s and 4 + s."""
    s = 2 * tl.arange(0, 4)[None, None, :] + h
    shift = 8 * (s % 4)
    a, b, c = (w1 >> shift) & 255, (w2 >> shift) & 255, (w3 >> shift) & 255
    low = s < 4
    sc = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q4_k_dot_kernel(XQ, XD, XS, W, Y, N, K, row_words, stride_y,
                     BLOCK_N: tl.constexpr, SB: tl.constexpr, EMULATE: tl.constexpr):
    """Program: BLOCK_N rows, SB super-blocks of each a loop step. A super-block is 36
    words: d and dmin (fp16), three of 6-bit scales and mins, then four runs of eight
    words of nibbles (run r's low nibbles: sub-block 2r; high: 2r + 1)."""
    pid, m = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    r = tl.arange(0, 4)[None, None, :, None]  # run
    j = tl.arange(0, 8)[None, None, None, :]  # word of the run
    row_w = W + rows.to(tl.int64)[:, None] * row_words  # [BN, 1]
    acc = tl.zeros([BLOCK_N, SB], dtype=tl.float32)
    xq = XQ + m * (K // 4)
    for sb0 in range(0, K // 256, SB):
        sb = sb0 + tl.arange(0, SB)[None, :]  # [1, SB]
        sb_ok = sb < K // 256
        live = ok[:, None] & sb_ok  # [BN, SB]
        blk = row_w + sb * 36  # [BN, SB] word pointers
        head = tl.load(blk, mask=live, other=0)
        d = (head & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (head >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        w1 = tl.load(blk + 1, mask=live, other=0)[:, :, None]
        w2 = tl.load(blk + 2, mask=live, other=0)[:, :, None]
        w3 = tl.load(blk + 3, mask=live, other=0)[:, :, None]
        q = tl.load(blk[:, :, None, None] + 4 + r * 8 + j, mask=live[:, :, None, None],
                    other=0)  # [BN, SB, 4, 8]
        at = sb[:, :, None, None] * 64 + r * 16 + j  # run r's low sub-block's x words
        x_lo = tl.load(xq + at, mask=sb_ok[:, :, None, None], other=0)
        x_hi = tl.load(xq + at + 8, mask=sb_ok[:, :, None, None], other=0)
        dot_lo = tl.sum(_dp4a(q & 0x0F0F0F0F, x_lo, 0, EMULATE), 3).to(tl.float32)
        dot_hi = tl.sum(_dp4a((q >> 4) & 0x0F0F0F0F, x_hi, 0, EMULATE), 3).to(tl.float32)
        sub = m * (K // 32) + sb[:, :, None] * 8 + 2 * tl.arange(0, 4)[None, None, :]
        x_ok = sb_ok[:, :, None]
        dx_lo = tl.load(XD + sub, mask=x_ok, other=0.0)
        dx_hi = tl.load(XD + sub + 1, mask=x_ok, other=0.0)
        sx_lo = tl.load(XS + sub, mask=x_ok, other=0.0)
        sx_hi = tl.load(XS + sub + 1, mask=x_ok, other=0.0)
        sc_lo, mn_lo = _k4_scales(w1, w2, w3, 0)
        sc_hi, mn_hi = _k4_scales(w1, w2, w3, 1)
        sums = tl.sum(sc_lo * dx_lo * dot_lo + sc_hi * dx_hi * dot_hi, 2)
        mins = tl.sum(mn_lo * sx_lo + mn_hi * sx_hi, 2)
        acc += d * sums - dmin * mins
    y = tl.sum(acc, 1)
    tl.store(Y + m * stride_y + rows, y.to(Y.dtype.element_ty), mask=ok)


# (rows a program, super-blocks of each a loop step, warps): the fastest on an H100 over
# Llama-3-8B's qkv and gate_up (.devrun/bench_dot.py, docs/benchmarks.md, session 28)
Q4_K_CONFIG = (2, 4, 1)


def q4_k_dot(xq: tuple[torch.Tensor, torch.Tensor, torch.Tensor], blocks: torch.Tensor,
             n: int, k: int, out: torch.Tensor, config=None) -> torch.Tensor:
    """``quantize_rows``' x [M, k] @ W.T for W [n, k] of Q4_K ``blocks`` -> ``out`` [M, n]."""
    _check(blocks, Q4_K, n, k)
    q, d, s = xq
    block_n, sb, warps = config or Q4_K_CONFIG
    words = blocks.view(torch.int32)
    _q4_k_dot_kernel[(triton.cdiv(n, block_n), q.shape[0])](
        q.view(torch.int32), d, s, words, out, n, k, words.shape[1], out.stride(0),
        BLOCK_N=block_n, SB=sb, EMULATE=EMULATE, num_warps=warps)
    return out


# ggml type -> its integer-dot product (the signature of ``q4_k_dot``)
DOTS = {Q4_K: q4_k_dot}

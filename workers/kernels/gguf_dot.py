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

Kernels: Q4_K (above), Q5_K (its fifth bit joined to each nibble from the high-bit
words), Q6_K (six bits from a nibble and two high bits; signed through its offset: a
group of 16's sum is sc * dx * (sum q qx - 32 sum qx)), Q8_0 (signed by signed) and Q4_0
(its offset of 8 through the block's float sum of x). Blocks whose size is not a
multiple of 4 bytes (Q8_0's 34, Q4_0's 18, Q6_K's 210) are read as pairs of int16; the
layouts the GPU path holds Q6_K and Q8_0 rows in (``gguf_gemv.REPACKED``: the same bytes,
4-byte aligned) have kernels of their own that read words, a lane per unit of the type.
``DOTS`` holds the ones the GPU path takes: those timed and checked on a GPU whose type
the GPU path keeps as blocks (``gguf_gemv.BLOCKS``: a float block kernel and a
dequantization for the other steps).

The kernels launch with programmatic dependent launch (``pdl.py``) and wait at their
start: the grid is resident while the launch before it drains.

Under Triton's CPU interpreter (no inline assembly) ``dp4a`` is four multiply-adds of
the bytes, the same integers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .gguf_gemv import Q4_0, Q4_K, Q5_K, Q6_K, Q6_K_PLANES, Q8_0, Q8_0_SPLIT, _check
from .fixed_sum import lane_sum
from .int8_blocks import store_int8_blocks
from .pdl import launch_options, wait_for_prior

EMULATE = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dp4a(a, b, c, EMULATE: tl.constexpr, SIGNED_A: tl.constexpr = False):
    """c + the sum of a's four bytes (unsigned, or signed with SIGNED_A) times b's four
    signed bytes (int32 each)."""
    if EMULATE:
        acc = c
        for i in tl.static_range(4):
            if SIGNED_A:
                ai = (a << (24 - 8 * i)) >> 24
            else:
                ai = (a >> (8 * i)) & 255
            acc += ai * ((b << (24 - 8 * i)) >> 24)
        return acc
    elif SIGNED_A:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [a, b, c], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _f16(h):
    """The fp16 in the low 16 bits of ``h`` (any int type), as float32."""
    return (h.to(tl.int32) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word(W16, at, mask):
    """The little-endian int32 of the two int16 at ``at`` and ``at + 1`` (blocks whose
    size is even but not a multiple of 4: Q8_0's 34 bytes, Q4_0's 18, Q6_K's 210)."""
    lo = tl.load(W16 + at, mask=mask, other=0).to(tl.int32) & 0xFFFF
    hi = tl.load(W16 + at + 1, mask=mask, other=0).to(tl.int32)
    return lo | (hi << 16)


@triton.jit
def _load(ptr, mask, EVEN: tl.constexpr):
    """``ptr``'s values; masked (0 where ``mask`` is false) unless EVEN (every lane live)."""
    if EVEN:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0)


@triton.jit
def _quantize_kernel(X, Q, D, S, K, stride_x, BLOCKS: tl.constexpr):
    """Program (row, BLOCKS blocks of 32): each block's amax / 127, its int8 codes
    (rounded to nearest even) and its float sum (``int8_blocks``)."""
    m, b0 = tl.program_id(0), tl.program_id(1) * BLOCKS
    blk = b0 + tl.arange(0, BLOCKS)
    cols = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(X + m * stride_x + cols, mask=(blk < K // 32)[:, None], other=0.0)
    store_int8_blocks(x.to(tl.float32), blk, m, K, Q, D, S, BLOCKS)


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
    """Sub-blocks 2r + h's (r = 0..3, the last axis) 6-bit scales and mins from a
    super-block's words 1-3 (bytes 4-15; w [BN, SB, 1] or [BN, SB, 4]) -> float32
    [BN, SB, 4] each: sub-block s < 4 is the low six bits of bytes 4 + s and 8 + s; s >= 4
    a nibble of byte 8 + s topped by the two high bits of bytes s and 4 + s."""
    s = 2 * tl.arange(0, 4)[None, None, :] + h
    shift = 8 * (s % 4)
    a, b, c = (w1 >> shift) & 255, (w2 >> shift) & 255, (w3 >> shift) & 255
    low = s < 4
    sc = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q4_k_dot_kernel(XQ, XD, XS, W, Y, N, K, row_words, stride_y,
                     BLOCK_N: tl.constexpr, SB: tl.constexpr, EMULATE: tl.constexpr,
                     PDL: tl.constexpr, EVEN: tl.constexpr):
    """Program: BLOCK_N rows, SB super-blocks of each a loop step. A super-block is 36
    words: d and dmin (fp16), three of 6-bit scales and mins, then four runs of eight
    words of nibbles (run r's low nibbles: sub-block 2r; high: 2r + 1). A thread owns one
    (row, super-block, run): the run's two halves load as two 4-word vectors of one layout,
    so both sub-blocks' integer dots are chains inside the thread and no lanes exchange
    values until the row's final sum (compiled for sm_90: ~3.3 instructions a weight byte,
    against ~6.5 when a run's words spread over two lanes; on an H100 no faster, so not
    issue-bound: docs/gpu_kernels.md). The high nibbles are dotted in place (16 times
    their value). EVEN: rows and super-blocks tile exactly, nothing masked."""
    wait_for_prior(PDL)
    pid, m = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, 4)[None, None, :]  # run
    w = tl.arange(0, 4)[None, None, None, :]  # word of a half-run
    row_w = W + rows.to(tl.int64)[:, None, None] * row_words  # [BN, 1, 1]
    acc = tl.zeros([BLOCK_N, SB, 4], dtype=tl.float32)
    for sb0 in range(0, K // 256, SB):
        sb = sb0 + tl.arange(0, SB)[None, :, None]  # [1, SB, 1]
        live = (rows < N)[:, None, None] & (sb < K // 256) & (r < 4)  # [BN, SB, 4]
        l4 = live[:, :, :, None]
        blk = row_w + sb * 36 + 0 * r  # each run's super-block
        q = blk[:, :, :, None] + 4 + 8 * r[:, :, :, None] + w
        qa, qb = _load(q, l4, EVEN), _load(q + 4, l4, EVEN)
        # x in the weights' tile shape (repeated over rows): loads, not lane shuffles
        x = XQ + m * (K // 4) + (0 * rows[:, None, None] + sb * 64 + 16 * r)[:, :, :, None] + w
        lo = _dp4a(qb & 0x0F0F0F0F, _load(x + 4, l4, EVEN),
                   _dp4a(qa & 0x0F0F0F0F, _load(x, l4, EVEN), 0, EMULATE), EMULATE)
        hi = _dp4a(qb & -0x0F0F0F10, _load(x + 12, l4, EVEN),  # -0x0F0F0F10: 0xF0F0F0F0
                   _dp4a(qa & -0x0F0F0F10, _load(x + 8, l4, EVEN), 0, EMULATE), EMULATE)
        head = _load(blk, live, EVEN)
        w1, w2, w3 = _load(blk + 1, live, EVEN), _load(blk + 2, live, EVEN), _load(blk + 3, live, EVEN)
        sc_lo, mn_lo = _k4_scales(w1, w2, w3, 0)
        sc_hi, mn_hi = _k4_scales(w1, w2, w3, 1)
        sub = XD + m * (K // 32) + 0 * rows[:, None, None] + sb * 8 + 2 * r  # x block 2r
        sums = XS + m * (K // 32) + 0 * rows[:, None, None] + sb * 8 + 2 * r
        acc += _f16(head) * (sc_lo * _load(sub, live, EVEN) * tl.sum(lo, 3).to(tl.float32)
                             + sc_hi * _load(sub + 1, live, EVEN)
                             * (tl.sum(hi, 3).to(tl.float32) * 0.0625)) \
            - _f16(head >> 16) * (mn_lo * _load(sums, live, EVEN)
                                  + mn_hi * _load(sums + 1, live, EVEN))
    y = tl.sum(tl.sum(acc, 2), 1)
    tl.store(Y + m * stride_y + rows, y.to(Y.dtype.element_ty), mask=rows < N)


@triton.jit
def _q8_0_dot_kernel(XQ, XD, W16, Y, N, K, row_halves, stride_y,
                     BLOCK_N: tl.constexpr, NB: tl.constexpr, EMULATE: tl.constexpr,
                     PDL: tl.constexpr):
    """Program: BLOCK_N rows, NB blocks of 32 of each a loop step. A block is 17 int16:
    d (fp16), then 32 int8 codes; w = d * q, both sides signed."""
    wait_for_prior(PDL)
    pid, m = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    j = tl.arange(0, 8)[None, None, :]
    row_h = rows.to(tl.int64)[:, None] * row_halves  # [BN, 1], in int16
    acc = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
    for b0 in range(0, K // 32, NB):
        b = b0 + tl.arange(0, NB)[None, :]
        b_ok = b < K // 32
        live = ok[:, None] & b_ok
        blk = row_h + b * 17
        d = _f16(tl.load(W16 + blk, mask=live, other=0))
        w = _word(W16, blk[:, :, None] + 1 + 2 * j, live[:, :, None])
        x = tl.load(XQ + m * (K // 4) + b[:, :, None] * 8 + j, mask=b_ok[:, :, None], other=0)
        dot = tl.sum(_dp4a(w, x, 0, EMULATE, True), 2).to(tl.float32)
        dx = tl.load(XD + m * (K // 32) + b, mask=b_ok, other=0.0)
        acc += d * dx * dot
    tl.store(Y + m * stride_y + rows, lane_sum(acc, BLOCK_N, NB).to(Y.dtype.element_ty),
             mask=ok)


@triton.jit
def _q8_0_split_dot_kernel(XQ, XD, W32, D16, Y, N, K, row_words, stride_y,
                           BLOCK_N: tl.constexpr, NB: tl.constexpr, EMULATE: tl.constexpr,
                           PDL: tl.constexpr, EVEN: tl.constexpr):
    """``_q8_0_dot_kernel`` on rows in ``Q8_0_SPLIT``'s layout: a row's K int8 codes, then
    its K/32 fp16 scales. A lane owns a block: its 32 codes load as two aligned 4-word
    vectors of one layout (the file's 34-byte blocks allow only 2-byte reads), its dot a
    dp4a chain inside the thread (compiled for sm_90: ~1 instruction a weight byte, against
    ~4.2 for the file layout's kernel; 15-18% faster on an H100).
    The sums are the file kernel's, in the same order (the blocks' lanes added by
    ``lane_sum`` in both). EVEN: rows and blocks tile exactly, nothing masked."""
    wait_for_prior(PDL)
    pid, m = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.arange(0, 4)[None, None, :]
    row_w = rows.to(tl.int64)[:, None] * row_words  # [BN, 1], in int32
    row_d = rows.to(tl.int64)[:, None] * (2 * row_words) + K // 2  # the scales, in int16
    acc = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
    for b0 in range(0, K // 32, NB):
        b = b0 + tl.arange(0, NB)[None, :]
        live = (rows < N)[:, None] & (b < K // 32)
        l3 = live[:, :, None]
        q = W32 + (row_w + b * 8)[:, :, None] + w
        # x in the weights' tile shape (repeated over rows): loads, not lane shuffles
        x = XQ + m * (K // 4) + (0 * row_w + b * 8)[:, :, None] + w
        dot = tl.sum(_dp4a(_load(q + 4, l3, EVEN), _load(x + 4, l3, EVEN),
                           _dp4a(_load(q, l3, EVEN), _load(x, l3, EVEN), 0, EMULATE, True),
                           EMULATE, True), 2)
        d = _f16(_load(D16 + row_d + b, live, EVEN))
        acc += d * _load(XD + m * (K // 32) + 0 * row_w + b, live, EVEN) * dot.to(tl.float32)
    tl.store(Y + m * stride_y + rows, lane_sum(acc, BLOCK_N, NB).to(Y.dtype.element_ty),
             mask=rows < N)


@triton.jit
def _q4_0_dot_kernel(XQ, XD, XS, W16, Y, N, K, row_halves, stride_y,
                     BLOCK_N: tl.constexpr, NB: tl.constexpr, EMULATE: tl.constexpr,
                     PDL: tl.constexpr):
    """A block is 9 int16: d (fp16), then 16 bytes whose low nibbles are weights 0-15 and
    high nibbles 16-31; w = d * (q - 8), so a block's sum is d * (dx * sum q qx - 8 * sum x)."""
    wait_for_prior(PDL)
    pid, m = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    j = tl.arange(0, 4)[None, None, :]
    row_h = rows.to(tl.int64)[:, None] * row_halves  # [BN, 1], in int16
    acc = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
    for b0 in range(0, K // 32, NB):
        b = b0 + tl.arange(0, NB)[None, :]
        b_ok = b < K // 32
        live = ok[:, None] & b_ok
        blk = row_h + b * 9
        d = _f16(tl.load(W16 + blk, mask=live, other=0))
        w = _word(W16, blk[:, :, None] + 1 + 2 * j, live[:, :, None])
        xw = XQ + m * (K // 4) + b[:, :, None] * 8 + j
        x_lo = tl.load(xw, mask=b_ok[:, :, None], other=0)
        x_hi = tl.load(xw + 4, mask=b_ok[:, :, None], other=0)
        dot = tl.sum(_dp4a(w & 0x0F0F0F0F, x_lo, 0, EMULATE)
                     + _dp4a((w >> 4) & 0x0F0F0F0F, x_hi, 0, EMULATE), 2).to(tl.float32)
        dx = tl.load(XD + m * (K // 32) + b, mask=b_ok, other=0.0)
        sx = tl.load(XS + m * (K // 32) + b, mask=b_ok, other=0.0)
        acc += d * (dx * dot - 8.0 * sx)
    tl.store(Y + m * stride_y + rows, tl.sum(acc, 1).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _q5_k_dot_kernel(XQ, XD, XS, W, Y, N, K, row_words, stride_y,
                     BLOCK_N: tl.constexpr, SB: tl.constexpr, EMULATE: tl.constexpr,
                     PDL: tl.constexpr):
    """Q4_K's super-block with a fifth bit: 44 words: d and dmin, three of 6-bit scales
    and mins, eight of high bits (byte i's bit s: sub-block s, position i), then the 32
    words of nibbles; w = d * sc * (q + 16 h) - dmin * m."""
    wait_for_prior(PDL)
    pid, m = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    r = tl.arange(0, 4)[None, None, :, None]
    j = tl.arange(0, 8)[None, None, None, :]
    row_w = W + rows.to(tl.int64)[:, None] * row_words
    acc = tl.zeros([BLOCK_N, SB], dtype=tl.float32)
    xq = XQ + m * (K // 4)
    for sb0 in range(0, K // 256, SB):
        sb = sb0 + tl.arange(0, SB)[None, :]
        sb_ok = sb < K // 256
        live = ok[:, None] & sb_ok
        blk = row_w + sb * 44
        head = tl.load(blk, mask=live, other=0)
        d, dmin = _f16(head), _f16(head >> 16)
        w1 = tl.load(blk + 1, mask=live, other=0)[:, :, None]
        w2 = tl.load(blk + 2, mask=live, other=0)[:, :, None]
        w3 = tl.load(blk + 3, mask=live, other=0)[:, :, None]
        qh = tl.load(blk[:, :, None, None] + 4 + j, mask=live[:, :, None, None], other=0)
        q = tl.load(blk[:, :, None, None] + 12 + r * 8 + j, mask=live[:, :, None, None],
                    other=0)
        lo = (q & 0x0F0F0F0F) | (((qh >> (2 * r)) & 0x01010101) << 4)
        hi = ((q >> 4) & 0x0F0F0F0F) | (((qh >> (2 * r + 1)) & 0x01010101) << 4)
        at = sb[:, :, None, None] * 64 + r * 16 + j
        x_lo = tl.load(xq + at, mask=sb_ok[:, :, None, None], other=0)
        x_hi = tl.load(xq + at + 8, mask=sb_ok[:, :, None, None], other=0)
        dot_lo = tl.sum(_dp4a(lo, x_lo, 0, EMULATE), 3).to(tl.float32)
        dot_hi = tl.sum(_dp4a(hi, x_hi, 0, EMULATE), 3).to(tl.float32)
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
    tl.store(Y + m * stride_y + rows, tl.sum(acc, 1).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _q6_k_dot_kernel(XQ, XD, W16, W8, Y, N, K, row_halves, stride_y,
                     BLOCK_N: tl.constexpr, SB: tl.constexpr, EMULATE: tl.constexpr,
                     PDL: tl.constexpr):
    """A super-block is 105 int16: ql[128] (half h's 64 bytes: low nibbles are its
    weights 0-63, high 64-127), qh[64] (half h's 32 bytes: bits 2j..2j+1 of byte i are
    weight 32 j + i), int8 scales[16] (one per 16 weights), d. w = d * sc * (q - 32): a
    group of 16's sum is d * sc * dx * (sum q qx - 32 sum qx). Tile axes: (row,
    super-block, half h, group g of 16 in a nibble run, word w of the group)."""
    wait_for_prior(PDL)
    pid, m = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    h = tl.arange(0, 2)[None, None, :, None, None]
    g = tl.arange(0, 4)[None, None, None, :, None]
    w = tl.arange(0, 4)[None, None, None, None, :]
    row_h = rows.to(tl.int64)[:, None] * row_halves  # [BN, 1], in int16
    acc = tl.zeros([BLOCK_N, SB], dtype=tl.float32)
    xq = XQ + m * (K // 4)
    for sb0 in range(0, K // 256, SB):
        sb = sb0 + tl.arange(0, SB)[None, :]
        sb_ok = sb < K // 256
        live = ok[:, None] & sb_ok
        blk = row_h + sb * 105  # [BN, SB]
        b5 = blk[:, :, None, None, None]
        l5 = live[:, :, None, None, None]
        d = _f16(tl.load(W16 + blk + 104, mask=live, other=0))
        for n in tl.static_range(2):  # low nibbles: the half's weights 0-63; high: 64-127
            ql = _word(W16, b5 + 32 * h + 2 * (4 * g + w), l5)  # bytes 64 h + 4 t
            qh = _word(W16, b5 + 64 + 16 * h + 2 * (4 * (g % 2) + w), l5)
            high = (qh >> (2 * (2 * n + g // 2))) & 0x03030303
            u = ((ql >> (4 * n)) & 0x0F0F0F0F) | (high << 4)
            x = tl.load(xq + sb[:, :, None, None, None] * 64 + 32 * h + 16 * n + 4 * g + w,
                        mask=sb_ok[:, :, None, None, None], other=0)
            dot = tl.sum(_dp4a(u, x, 0, EMULATE), 4)  # [BN, SB, 2, 4]
            xsum = tl.sum(_dp4a(x * 0 + 0x01010101, x, 0, EMULATE), 4)  # each group's sum qx
            h4, g4 = tl.arange(0, 2)[None, None, :, None], tl.arange(0, 4)[None, None, None, :]
            sc = tl.load(W8 + 2 * blk[:, :, None, None] + 192 + 8 * h4 + 4 * n + g4,
                         mask=live[:, :, None, None], other=0).to(tl.float32)
            dx = tl.load(XD + m * (K // 32) + sb[:, :, None, None] * 8 + 4 * h4 + 2 * n + g4 // 2,
                         mask=sb_ok[:, :, None, None], other=0.0)
            acc += d * tl.sum(tl.sum(sc * dx * (dot - 32 * xsum).to(tl.float32), 3), 2)
    tl.store(Y + m * stride_y + rows, tl.sum(acc, 1).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _group_dot(u, x, EMULATE: tl.constexpr):
    """(sum u x, sum x) of a thread's 4 words (axis 4) of one group of 16 Q6_K weights."""
    return (tl.sum(_dp4a(u, x, 0, EMULATE), 4),
            tl.sum(_dp4a(x * 0 + 0x01010101, x, 0, EMULATE), 4))


@triton.jit
def _q6_k_planes_dot_kernel(XQ, XD, W16, W8, W32, Y, N, K, row_halves, stride_y,
                            BLOCK_N: tl.constexpr, SB: tl.constexpr, EMULATE: tl.constexpr,
                            PDL: tl.constexpr, EVEN: tl.constexpr):
    """``_q6_k_dot_kernel`` on rows in ``Q6_K_PLANES``' layout (the ql, qh, scales and d of
    all super-blocks, each plane 4-byte aligned). A thread owns one (row, super-block, half
    h, run L) unit, l = 16 L .. 16 L + 15: four words each of ql[l], ql[l + 32] and qh[l],
    the 64 weights 128 h + 32 t + l (t = 0..3: ql[l]'s and ql[l + 32]'s low, then high
    nibbles, topped by qh's bit pairs 2t), four groups of 16 with scales sc[8 h + L + 2 t].
    Each group's integer dot is a chain inside the thread: no lane exchanges until the
    row's final sum (compiled for sm_90: ~3.3 instructions a weight byte, against ~9-11 for
    the file layout's kernel; on an H100 as fast as the planes read two lanes to a unit).
    EVEN: rows and super-blocks tile exactly, nothing masked."""
    wait_for_prior(PDL)
    pid, m = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.arange(0, 2)[None, None, :, None]
    L = tl.arange(0, 2)[None, None, None, :]
    w = tl.arange(0, 4)[None, None, None, None, :]
    row_h = rows.to(tl.int64)[:, None, None, None] * row_halves  # in int16
    acc = tl.zeros([BLOCK_N, SB, 2, 2], dtype=tl.float32)
    for sb0 in range(0, K // 256, SB):
        sb = sb0 + tl.arange(0, SB)[None, :, None, None]
        live = (rows < N)[:, None, None, None] & (sb < K // 256) & (h < 2) & (L < 2)
        l5 = live[:, :, :, :, None]
        ql = W32 + (row_h // 2 + sb * 32 + 16 * h + 4 * L)[:, :, :, :, None] + w
        qa, qb = _load(ql, l5, EVEN), _load(ql + 8, l5, EVEN)
        qh = _load(W32 + (row_h // 2 + K // 8 + sb * 16 + 8 * h + 4 * L)[:, :, :, :, None] + w,
                   l5, EVEN)
        # x in the weights' tile shape (repeated over rows): loads, not lane shuffles
        x = XQ + m * (K // 4) + (0 * row_h + sb * 64 + 32 * h + 4 * L)[:, :, :, :, None] + w
        d0, s0 = _group_dot((qa & 0x0F0F0F0F) | ((qh << 4) & 0x30303030), _load(x, l5, EVEN), EMULATE)
        d1, s1 = _group_dot((qb & 0x0F0F0F0F) | ((qh << 2) & 0x30303030), _load(x + 8, l5, EVEN),
                            EMULATE)
        d2, s2 = _group_dot(((qa >> 4) & 0x0F0F0F0F) | (qh & 0x30303030), _load(x + 16, l5, EVEN),
                            EMULATE)
        d3, s3 = _group_dot(((qb >> 4) & 0x0F0F0F0F) | ((qh >> 2) & 0x30303030),
                            _load(x + 24, l5, EVEN), EMULATE)
        d = _f16(_load(W16 + row_h + 13 * (K // 32) + sb + 0 * (h + L), live, EVEN))
        sc = W8 + 2 * row_h + 3 * (K // 4) + sb * 16 + 8 * h + L  # sc[8 h + L + 2 t]
        dx = XD + m * (K // 32) + 0 * row_h + sb * 8 + 4 * h + 0 * L  # x block 4 h + t
        acc += d * (_load(sc, live, EVEN).to(tl.float32) * _load(dx, live, EVEN)
                    * (d0 - 32 * s0).to(tl.float32)
                    + _load(sc + 2, live, EVEN).to(tl.float32) * _load(dx + 1, live, EVEN)
                    * (d1 - 32 * s1).to(tl.float32)
                    + _load(sc + 4, live, EVEN).to(tl.float32) * _load(dx + 2, live, EVEN)
                    * (d2 - 32 * s2).to(tl.float32)
                    + _load(sc + 6, live, EVEN).to(tl.float32) * _load(dx + 3, live, EVEN)
                    * (d3 - 32 * s3).to(tl.float32))
    y = tl.sum(tl.sum(tl.sum(acc, 3), 2), 1)
    tl.store(Y + m * stride_y + rows, y.to(Y.dtype.element_ty), mask=rows < N)


def _blocks_as(blocks: torch.Tensor, ggml_type: int, n: int, k: int, dtype: torch.dtype
               ) -> torch.Tensor:
    """``blocks`` (uint8 [n, row_bytes] of ``ggml_type``) viewed as ``dtype`` units."""
    from ..loader.gguf_quants import GGML_TYPES

    _, per, size = GGML_TYPES[ggml_type]
    if k % per or tuple(blocks.shape) != (n, k // per * size) or blocks.dtype != torch.uint8:
        raise ValueError(f"blocks {tuple(blocks.shape)} {blocks.dtype} do not hold a [{n}, {k}] "
                         f"matrix of type {ggml_type}")
    return blocks.view(dtype)


def _even(n: int, k: int, config, per: int = 256) -> bool:
    """Whether ``config``'s programs tile n rows of k // per (super-)blocks exactly."""
    return n % config[0] == 0 and (k // per) % config[1] == 0


def _launch(kernel, xq, words: torch.Tensor, out: torch.Tensor, n: int, k: int, config,
            *weights, **constexprs) -> torch.Tensor:
    """One program per ``config[0]`` rows and row of x; ``weights``: the kernel's block
    pointers (``words`` first, whose row length in its units the kernel takes)."""
    block_n, depth, warps = config
    kernel[(triton.cdiv(n, block_n), xq[0].shape[0])](
        *xq, *weights, out, n, k, words.shape[1], out.stride(0), block_n, depth, EMULATE,
        num_warps=warps, **constexprs, **launch_options(out.device))
    return out


# (rows a program, blocks (Q8_0) or super-blocks (Q6_K) of each a loop step, warps): the
# fastest on an H100 over Llama-3-8B's four projection shapes (``bench_gguf --tune``,
# docs/benchmarks.md, session 29; Q6_K's qkv alone preferred two rows, by 1%)
Q8_0_CONFIG = (1, 16, 1)
Q8_0_SPLIT_CONFIG = (1, 64, 1)  # two blocks a lane
Q6_K_CONFIG = (1, 2, 1)
# Q6_K planes: one row a program, a unit per lane (BLOCK_N * SB * 4 = 32 lanes a warp, so
# no lane holds a partial unit). Chosen before timing: on an H100 (2, 4, 1) was faster at
# every Llama-3-8B shape (docs/benchmarks.md, session 40); not yet changed
Q6_K_PLANES_CONFIG = (1, 8, 1)


def q8_0_dot(xq, blocks, n, k, out, config=None):
    """As ``q4_k_dot``, for Q8_0 blocks."""
    q, d, _ = xq
    w = _blocks_as(blocks, Q8_0, n, k, torch.int16)
    return _launch(_q8_0_dot_kernel, (q.view(torch.int32), d), w, out, n, k,
                   config or Q8_0_CONFIG, w)


def q8_0_split_dot(xq, split, n, k, out, config=None):
    """As ``q8_0_dot``, for rows repacked by ``gguf_gemv.q8_0_split``."""
    q, d, _ = xq
    if k % 64 or tuple(split.shape) != (n, k // 32 * 34) or split.dtype != torch.uint8:
        raise ValueError(f"{tuple(split.shape)} {split.dtype} is no split Q8_0 [{n}, {k}] matrix")
    w = split.view(torch.int32)
    config = config or Q8_0_SPLIT_CONFIG
    return _launch(_q8_0_split_dot_kernel, (q.view(torch.int32), d), w, out, n, k, config,
                   w, split.view(torch.int16), EVEN=_even(n, k, config, 32))


def q4_0_dot(xq, blocks, n, k, out, config=None):
    """As ``q4_k_dot``, for Q4_0 blocks."""
    q, d, s = xq
    w = _blocks_as(blocks, Q4_0, n, k, torch.int16)
    return _launch(_q4_0_dot_kernel, (q.view(torch.int32), d, s), w, out, n, k,
                   config or (2, 8, 1), w)


def q5_k_dot(xq, blocks, n, k, out, config=None):
    """As ``q4_k_dot``, for Q5_K blocks."""
    q, d, s = xq
    w = _blocks_as(blocks, Q5_K, n, k, torch.int32)
    return _launch(_q5_k_dot_kernel, (q.view(torch.int32), d, s), w, out, n, k,
                   config or (2, 4, 1), w)


def q6_k_dot(xq, blocks, n, k, out, config=None):
    """As ``q4_k_dot``, for Q6_K blocks."""
    q, d, _ = xq
    w = _blocks_as(blocks, Q6_K, n, k, torch.int16)
    return _launch(_q6_k_dot_kernel, (q.view(torch.int32), d), w, out, n, k,
                   config or Q6_K_CONFIG, w, blocks.view(torch.int8))


def q6_k_planes_dot(xq, blocks, n, k, out, config=None):
    """As ``q6_k_dot``, for rows repacked by ``gguf_gemv.q6_k_planes`` (k a multiple of
    512, so that every plane is 4-byte aligned)."""
    q, d, _ = xq
    if k % 512:
        raise ValueError(f"Q6_K planes need rows of a multiple of 512 weights, got {k}")
    w = _blocks_as(blocks, Q6_K, n, k, torch.int16)
    config = config or Q6_K_PLANES_CONFIG
    return _launch(_q6_k_planes_dot_kernel, (q.view(torch.int32), d), w, out, n, k, config,
                   w, blocks.view(torch.int8), blocks.view(torch.int32),
                   EVEN=_even(n, k, config))


# (rows a program, super-blocks of each a loop step, warps), a (row, super-block, run) per
# lane: two rows a program for qkv and gate_up, one for the products of at most 4,096
# rows (o, down). Chosen before the lane-per-run kernel was timed: on an H100 (2, 4, 1)
# beat the narrow tile at o and down (docs/benchmarks.md, session 40); not yet changed
Q4_K_CONFIG, Q4_K_NARROW_CONFIG = (2, 4, 1), (1, 8, 1)


def q4_k_dot(xq: tuple[torch.Tensor, torch.Tensor, torch.Tensor], blocks: torch.Tensor,
             n: int, k: int, out: torch.Tensor, config=None) -> torch.Tensor:
    """``quantize_rows``' x [M, k] @ W.T for W [n, k] of Q4_K ``blocks`` -> ``out`` [M, n]."""
    _check(blocks, Q4_K, n, k)
    q, d, s = xq
    config = config or (Q4_K_NARROW_CONFIG if n <= 4096 else Q4_K_CONFIG)
    words = blocks.view(torch.int32)
    return _launch(_q4_k_dot_kernel, (q.view(torch.int32), d, s), words, out, n, k, config,
                   words, EVEN=_even(n, k, config))


# ggml type -> its integer-dot product (the signature of ``q4_k_dot``): every kernel here,
# and those the GPU path takes (timed and checked on a GPU, docs/benchmarks.md, where they
# beat the float block gemv). Q4_0's dots are not taken: on an H100 they were slower than
# its float block gemv at two of Llama-3-8B's four shapes (session 34).
KERNELS = {Q4_K: q4_k_dot, Q8_0: q8_0_dot, Q4_0: q4_0_dot, Q5_K: q5_k_dot, Q6_K: q6_k_dot}
DOTS = {Q4_K: q4_k_dot, Q5_K: q5_k_dot, Q6_K: q6_k_dot, Q8_0: q8_0_dot,
        Q6_K_PLANES: q6_k_planes_dot, Q8_0_SPLIT: q8_0_split_dot}

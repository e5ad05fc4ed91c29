"""Products of a few rows with a GGUF block matrix on the GPU, read in its blocks.

A batch-1 decode step reads every weight once, so a Q4_K matrix read as its blocks
(4.5 bits a weight) costs about a third of the bytes of its bfloat16 copy. These
kernels decode the blocks in registers and never write a float copy.

The matrix is the file's bytes as a uint8 tensor [N, row_bytes] (GGUF lays a matrix out
row by row, a row one output feature, each row a run of blocks along the input). Each
program owns ``BLOCK_N`` rows and one row of x, and walks the whole input one block (or
super-block) at a time. Within a (sub-)block every weight is scale * q (- min), so a
row's sum is taken per sub-block first, sum(q * x), then scaled once: the decode work
per weight is an unpack and a multiply-add.

Layouts (``loader/gguf_quants.py`` decodes the same bytes in numpy, the reference):
- Q8_0, 34 bytes per 32 weights: f16 d, int8 q[32]; w = d * q.
- Q4_K, 144 bytes per 256: f16 d, f16 dmin, twelve bytes of eight 6-bit scales and
  mins, q[128]: four runs of 32 bytes, each run's low nibbles one sub-block of 32
  and its high nibbles the next; w = d * scale * q - dmin * min.
- Q4_0, 18 bytes per 32: f16 d, q[16]: weight i < 16 the low nibble of q[i], 16 + i
  its high nibble; w = d * (q - 8).
- Q5_K, 176 bytes per 256: Q4_K's d, dmin and scales, then qh[32] (bit s of qh[i]: the
  fifth bit of weight i of sub-block s), then q[128] as Q4_K's; w = d * scale * q - dmin
  * min, q of 0..31.
- IQ4_XS, 136 bytes per 256: f16 d, u16 scales_h, scales_l[4], q[128]: sub-block s of 32
  has the 6-bit scale (nibble s % 2 of scales_l[s // 2]) | (bits 2s..2s+1 of scales_h)
  << 4, and reads q[16 s:16 s + 16] as Q4_0 does; w = d * (scale - 32) * LEVELS[q].
- Q6_K, 210 bytes per 256: ql[128] (low nibbles), qh[64] (two high bits), int8
  scales[16] (one per 16 weights), f16 d; w = d * scale * (q - 32). Each half of 128
  weights reads ql[64 h:64 h + 64] (low nibbles: weights 0-63, high: 64-127) and
  qh[32 h:32 h + 32] (bits 2j..2j+1: weights 32j..32j+31).
- ``Q6_K_PLANES``: Q6_K rows repacked at load (``q6_k_planes``) into planes: a row's ql
  of every super-block, then its qh, scales and d; the same bytes. A file's 210-byte
  super-blocks allow only 2-byte reads; in planes (K a multiple of 512) every plane is
  4-byte aligned, so the integer dots read words (docs/gpu_kernels.md).
- ``Q8_0_SPLIT``: Q8_0 rows repacked at load (``q8_0_split``): a row's K int8 codes, then
  its K/32 fp16 scales; the same bytes, the codes 4-byte aligned (K a multiple of 64).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pocketllm.errors import UnsupportedFeatureError

Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS = 2, 8, 12, 13, 14, 23
# ggml type -> (weights per block, bytes per block): the types these kernels read
# no ggml types: layouts of Q6_K's and Q8_0's bytes the GPU path holds (``REPACKED``)
Q6_K_PLANES, Q8_0_SPLIT = "q6_k_planes", "q8_0_split"
FORMATS = {Q4_0: (32, 18), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
           IQ4_XS: (256, 136), Q6_K_PLANES: (256, 210), Q8_0_SPLIT: (32, 34)}
# the ones the GPU path keeps as blocks (``KernelPolicy.linear_method``): those whose
# kernels also ran compiled on a GPU, checked and timed there (all six since session 34:
# docs/benchmarks.md); another type's file dequantizes at load, saying so
BLOCKS = {t: f for t, f in FORMATS.items() if t not in (Q6_K_PLANES, Q8_0_SPLIT)}
# IQ4_XS's (and IQ4_NL's) 16 levels a nibble picks (ggml's kvalues_iq4nl)
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_levels: dict = {}  # device -> IQ4_LEVELS as a float32 tensor there


@triton.jit
def _f16_at(ptrs, mask):
    """The little-endian fp16 at byte pointers ``ptrs``, as float32 (0 where masked)."""
    lo = tl.load(ptrs, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptrs + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _block32_fields(row_ptr, blk, K, BYTES: tl.constexpr, SPLIT: tl.constexpr):
    """Byte pointers to block ``blk``'s codes and fp16 d in rows at ``row_ptr``: in the
    file's blocks (d, then the codes), or (SPLIT, ``q8_0_split``) in a row's codes of all
    its blocks, then all its d."""
    if SPLIT:
        return row_ptr + blk * 32, row_ptr + K + blk * 2
    else:
        return row_ptr + blk * BYTES + 2, row_ptr + blk * BYTES


@triton.jit
def _q8_0_q4_0_kernel(X, W, Y, N, K, row_bytes, stride_x, stride_y, BYTES: tl.constexpr,
                      CODES: tl.constexpr, BLOCK_N: tl.constexpr, DEPTH: tl.constexpr,
                      SPLIT: tl.constexpr = False):
    """Blocks of 32 (an fp16 d, then CODES bytes of codes: Q8_0's 32 int8, Q4_0's 16 bytes
    of nibbles, each less 8), DEPTH of them a loop step; SPLIT: ``Q8_0_SPLIT`` rows."""
    pid, m = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    base = W + rows.to(tl.int64)[:, None, None] * row_bytes
    g = tl.arange(0, DEPTH)[None, :, None]
    i = tl.arange(0, CODES)[None, None, :]
    acc = tl.zeros([BLOCK_N, DEPTH], dtype=tl.float32)
    for b0 in range(0, K // 32, DEPTH):
        blk = b0 + g
        live = (blk < K // 32) & ok[:, None, None]
        codes, _ = _block32_fields(base, blk, K, BYTES, SPLIT)
        q = tl.load(codes + i, mask=live, other=0)
        xs = X + m * stride_x + blk * 32 + i
        if CODES == 32:
            x = tl.load(xs, mask=blk < K // 32, other=0.0)
            dot = tl.sum(q.to(tl.int8, bitcast=True).to(tl.float32) * x.to(tl.float32), 2)
        else:  # low nibbles: weights 0-15, high: 16-31
            q = q.to(tl.int32)
            x_lo = tl.load(xs, mask=blk < K // 32, other=0.0).to(tl.float32)
            x_hi = tl.load(xs + 16, mask=blk < K // 32, other=0.0).to(tl.float32)
            dot = tl.sum(((q & 15) - 8).to(tl.float32) * x_lo
                         + ((q >> 4) - 8).to(tl.float32) * x_hi, 2)
        first = (b0 + tl.arange(0, DEPTH))[None, :]
        _, d_at = _block32_fields(W + rows.to(tl.int64)[:, None] * row_bytes, first, K, BYTES, SPLIT)
        d = _f16_at(d_at, (first < K // 32) & ok[:, None])
        acc += d * dot
    tl.store(Y + m * stride_y + rows, tl.sum(acc, 1).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _q4_k_q5_k_kernel(X, W, Y, N, K, row_bytes, stride_x, stride_y, FIVE: tl.constexpr,
                      BLOCK_N: tl.constexpr, DEPTH: tl.constexpr):
    """DEPTH super-blocks of each row a loop step: the (row, super-block) pairs are one
    axis of BLOCK_N * DEPTH, summed per row at the end. ``FIVE``: Q5_K, each nibble
    topped by its bit of the 32 bytes qh before the codes."""
    pid, m = tl.program_id(0), tl.program_id(1)
    p = tl.arange(0, BLOCK_N * DEPTH)
    rows = pid * BLOCK_N + p // DEPTH
    ok = rows < N
    row_ptr = W + rows.to(tl.int64) * row_bytes  # [P]
    run = tl.arange(0, 4)[None, :, None]  # four 32-byte runs: sub-blocks 2 run (low), 2 run + 1
    i = tl.arange(0, 32)[None, None, :]
    sub = tl.arange(0, 4)
    acc = tl.zeros([BLOCK_N * DEPTH], dtype=tl.float32)
    for sb0 in range(0, K // 256, DEPTH):
        sb = sb0 + p % DEPTH
        live = ok & (sb < K // 256)
        blk = row_ptr + sb * (144 + 32 * FIVE)
        q = tl.load(blk[:, None, None] + (16 + 32 * FIVE) + run * 32 + i,
                    mask=live[:, None, None], other=0)
        q_lo, q_hi = q & 15, q >> 4
        if FIVE:
            qh = tl.load(blk[:, None, None] + 16 + i, mask=live[:, None, None],
                         other=0).to(tl.int32)
            q_lo = q_lo.to(tl.int32) | (((qh >> (2 * run)) & 1) << 4)
            q_hi = q_hi.to(tl.int32) | (((qh >> (2 * run + 1)) & 1) << 4)
        xs = X + m * stride_x + sb[:, None, None] * 256 + run * 64 + i  # [P, 4, 32]
        x_lo = tl.load(xs, mask=live[:, None, None], other=0.0).to(tl.float32)
        x_hi = tl.load(xs + 32, mask=live[:, None, None], other=0.0).to(tl.float32)
        dot_lo = tl.sum(q_lo.to(tl.float32) * x_lo, 2)  # [P, 4]
        dot_hi = tl.sum(q_hi.to(tl.float32) * x_hi, 2)
        sc_lo, mn_lo = _k4_scale_min(blk, 2 * sub, live)
        sc_hi, mn_hi = _k4_scale_min(blk, 2 * sub + 1, live)
        sums = _f16_at(blk, live) * tl.sum(sc_lo * dot_lo + sc_hi * dot_hi, 1)
        mins = _f16_at(blk + 2, live) * tl.sum(mn_lo * tl.sum(x_lo, 2) + mn_hi * tl.sum(x_hi, 2), 1)
        acc += sums - mins
    y = tl.sum(tl.reshape(acc, [BLOCK_N, DEPTH]), 1)
    out = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(Y + m * stride_y + out, y.to(Y.dtype.element_ty), mask=out < N)


@triton.jit
def _k4_scale_min(blk, s, ok):
    """Sub-blocks ``s``' (of 8) 6-bit scales and mins from bytes 4-15: for s < 4 the low
    six bits of bytes 4 + s and 8 + s; else nibbles of byte 8 + s topped by the high two
    bits of bytes s and 4 + s. -> float32 [len(blk), len(s)] each."""
    j = s % 4
    a = tl.load(blk[:, None] + 4 + j[None, :], mask=ok[:, None], other=0).to(tl.int32)
    b = tl.load(blk[:, None] + 8 + j[None, :], mask=ok[:, None], other=0).to(tl.int32)
    c = tl.load(blk[:, None] + 12 + j[None, :], mask=ok[:, None], other=0).to(tl.int32)
    low = (s < 4)[None, :]
    scale = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return scale.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _iq4_xs_scales(blk, ok):
    """The eight sub-blocks' scales - 32 at super-block pointers ``blk`` -> float32 [P, 8]."""
    s = tl.arange(0, 8)[None, :]
    low = tl.load(blk[:, None] + 4 + s // 2, mask=ok[:, None], other=0).to(tl.int32)
    h0 = tl.load(blk[:, None] + 2, mask=ok[:, None], other=0).to(tl.int32)
    h1 = tl.load(blk[:, None] + 3, mask=ok[:, None], other=0).to(tl.int32)
    high = ((h0 | (h1 << 8)) >> (2 * s)) & 3
    return (((low >> (4 * (s % 2))) & 15) | (high << 4)).to(tl.float32) - 32.0


@triton.jit
def _iq4_xs_kernel(X, W, Y, N, K, row_bytes, stride_x, stride_y, LEVELS,
                   BLOCK_N: tl.constexpr, DEPTH: tl.constexpr):
    """(row, super-block) pairs as in ``_q4_k_q5_k_kernel``; a nibble's level is a load from
    ``LEVELS`` (16 floats, cached)."""
    pid, m = tl.program_id(0), tl.program_id(1)
    p = tl.arange(0, BLOCK_N * DEPTH)
    rows = pid * BLOCK_N + p // DEPTH
    ok = rows < N
    row_ptr = W + rows.to(tl.int64) * row_bytes
    sub = tl.arange(0, 8)[None, :, None]
    j = tl.arange(0, 16)[None, None, :]
    acc = tl.zeros([BLOCK_N * DEPTH], dtype=tl.float32)
    for sb0 in range(0, K // 256, DEPTH):
        sb = sb0 + p % DEPTH
        live = ok & (sb < K // 256)
        blk = row_ptr + sb * 136
        q = tl.load(blk[:, None, None] + 8 + sub * 16 + j, mask=live[:, None, None],
                    other=0).to(tl.int32)
        xs = X + m * stride_x + sb[:, None, None] * 256 + sub * 32 + j  # [P, 8, 16]
        x_lo = tl.load(xs, mask=live[:, None, None], other=0.0).to(tl.float32)
        x_hi = tl.load(xs + 16, mask=live[:, None, None], other=0.0).to(tl.float32)
        dot = tl.sum(tl.load(LEVELS + (q & 15)) * x_lo + tl.load(LEVELS + (q >> 4)) * x_hi, 2)
        acc += _f16_at(blk, live) * tl.sum(_iq4_xs_scales(blk, live) * dot, 1)
    y = tl.sum(tl.reshape(acc, [BLOCK_N, DEPTH]), 1)
    out = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(Y + m * stride_y + out, y.to(Y.dtype.element_ty), mask=out < N)


@triton.jit
def _q6_k_fields(row_ptr, sb, K, PLANES: tl.constexpr):
    """Byte pointers to super-block ``sb``'s ql[128], qh[64], scales[16] and d of rows at
    ``row_ptr``: in the file's 210-byte super-blocks, or (PLANES, ``q6_k_planes``) in each
    row's planes of all its ql, then all its qh, scales and d."""
    if PLANES:
        return (row_ptr + sb * 128, row_ptr + K // 2 + sb * 64, row_ptr + 3 * (K // 4) + sb * 16,
                row_ptr + 13 * (K // 16) + sb * 2)
    else:
        blk = row_ptr + sb * 210
        return blk, blk + 128, blk + 192, blk + 208


@triton.jit
def _q6_k_kernel(X, W, Y, N, K, row_bytes, stride_x, stride_y, BLOCK_N: tl.constexpr,
                 DEPTH: tl.constexpr, PLANES: tl.constexpr = False):
    """(row, super-block) pairs as in ``_q4_k_q5_k_kernel``."""
    pid, m = tl.program_id(0), tl.program_id(1)
    p = tl.arange(0, BLOCK_N * DEPTH)
    rows = pid * BLOCK_N + p // DEPTH
    ok = rows < N
    row_ptr = W + rows.to(tl.int64) * row_bytes
    sub = tl.arange(0, 4)  # four sub-blocks of 16 in each 64-weight quarter
    lane = (sub[:, None] * 16 + tl.arange(0, 16)[None, :])[None]  # [1, 4, 16]
    shift = 2 * (lane // 32)  # weights 32j.. of a 64-run read bits 2j
    acc = tl.zeros([BLOCK_N * DEPTH], dtype=tl.float32)
    for sb0 in range(0, K // 256, DEPTH):
        sb = sb0 + p % DEPTH
        live = ok & (sb < K // 256)
        qlp, qhp, scp, dp = _q6_k_fields(row_ptr, sb, K, PLANES)
        d = _f16_at(dp, live)
        xrow = X + m * stride_x + sb[:, None, None] * 256 + lane
        for h in tl.static_range(2):
            ql = tl.load(qlp[:, None, None] + 64 * h + lane, mask=live[:, None, None],
                         other=0).to(tl.int32)
            qh = tl.load(qhp[:, None, None] + 32 * h + lane % 32, mask=live[:, None, None],
                         other=0).to(tl.int32)
            for nib in tl.static_range(2):  # low nibbles: weights 0-63; high: 64-127
                q = ((ql >> (4 * nib)) & 15) | (((qh >> (shift + 4 * nib)) & 3) << 4)
                x = tl.load(xrow + 128 * h + 64 * nib, mask=live[:, None, None],
                            other=0.0).to(tl.float32)
                dot = tl.sum((q - 32).to(tl.float32) * x, 2)  # [P, 4]
                sc = tl.load(scp[:, None] + 8 * h + 4 * nib + sub[None, :],
                             mask=live[:, None], other=0).to(tl.int8, bitcast=True)
                acc += d * tl.sum(sc.to(tl.float32) * dot, 1)
    y = tl.sum(tl.reshape(acc, [BLOCK_N, DEPTH]), 1)
    out = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(Y + m * stride_y + out, y.to(Y.dtype.element_ty), mask=out < N)


@triton.jit
def _dequant_q8_0_q4_0_kernel(W, Out, N, K, row_bytes, BYTES: tl.constexpr,
                              CODES: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                              SPLIT: tl.constexpr = False):
    """Program (row tile, GROUP blocks of 32): Q8_0 (SPLIT: ``Q8_0_SPLIT`` rows), or Q4_0
    (``CODES`` 16: nibbles)."""
    pid, g0 = tl.program_id(0), tl.program_id(1) * GROUP
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    g = g0 + tl.arange(0, GROUP)
    i = tl.arange(0, CODES)
    live = (rows < N)[:, None] & (g < K // 32)[None, :]
    codes, d_at = _block32_fields(W + rows.to(tl.int64)[:, None] * row_bytes, g[None, :], K,
                                  BYTES, SPLIT)  # [BLOCK_N, GROUP] each
    q = tl.load(codes[:, :, None] + i[None, None, :], mask=live[:, :, None], other=0)
    d = _f16_at(d_at, live)[:, :, None]
    out = Out + rows.to(tl.int64)[:, None, None] * K + g[None, :, None] * 32 + i[None, None, :]
    if CODES == 32:
        w = q.to(tl.int8, bitcast=True).to(tl.float32) * d
        tl.store(out, w.to(Out.dtype.element_ty), mask=live[:, :, None])
    else:
        for half in tl.static_range(2):  # low nibbles: weights 0-15; high: 16-31
            w = (((q >> (4 * half)) & 15).to(tl.int32) - 8).to(tl.float32) * d
            tl.store(out + 16 * half, w.to(Out.dtype.element_ty), mask=live[:, :, None])


@triton.jit
def _dequant_q4_k_q5_k_kernel(W, Out, N, K, row_bytes, FIVE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (row tile, super-block); ``FIVE``: Q5_K (nibbles topped by bits of qh)."""
    pid, sb = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    blk = W + rows.to(tl.int64) * row_bytes + sb * (144 + 32 * FIVE)
    run = tl.arange(0, 4)
    i = tl.arange(0, 32)
    q = tl.load(blk[:, None, None] + (16 + 32 * FIVE) + run[None, :, None] * 32
                + i[None, None, :], mask=ok[:, None, None], other=0).to(tl.int32)
    d = _f16_at(blk, ok)[:, None, None]
    dmin = _f16_at(blk + 2, ok)[:, None, None]
    out = Out + rows.to(tl.int64)[:, None, None] * K + sb * 256 + run[None, :, None] * 64 + i[None, None, :]
    for half in tl.static_range(2):  # low nibbles: sub-block 2 run; high: 2 run + 1
        s = 2 * run + half
        sc, mn = _k4_scale_min(blk, s, ok)
        qs = (q >> (4 * half)) & 15
        if FIVE:
            qh = tl.load(blk[:, None, None] + 16 + i[None, None, :], mask=ok[:, None, None],
                         other=0).to(tl.int32)
            qs = qs | (((qh >> s[None, :, None]) & 1) << 4)
        w = d * sc[:, :, None] * qs.to(tl.float32) - dmin * mn[:, :, None]
        tl.store(out + 32 * half, w.to(Out.dtype.element_ty), mask=ok[:, None, None])


@triton.jit
def _dequant_q6_k_kernel(W, Out, N, K, row_bytes, BLOCK_N: tl.constexpr,
                         PLANES: tl.constexpr = False):
    """Program (row tile, super-block)."""
    pid, sb = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    qlp, qhp, scp, dp = _q6_k_fields(W + rows.to(tl.int64) * row_bytes, sb, K, PLANES)
    sub = tl.arange(0, 4)
    lane = sub[:, None] * 16 + tl.arange(0, 16)[None, :]  # [4, 16]
    d = _f16_at(dp, ok)[:, None, None]
    out = Out + rows.to(tl.int64)[:, None, None] * K + sb * 256 + lane[None]
    for h in tl.static_range(2):
        ql = tl.load(qlp[:, None, None] + 64 * h + lane[None], mask=ok[:, None, None],
                     other=0).to(tl.int32)
        qh = tl.load(qhp[:, None, None] + 32 * h + lane[None] % 32, mask=ok[:, None, None],
                     other=0).to(tl.int32)
        shift = 2 * (lane // 32)[None]
        for nib in tl.static_range(2):
            q = ((ql >> (4 * nib)) & 15) | (((qh >> (shift + 4 * nib)) & 3) << 4)
            sc = tl.load(scp[:, None] + 8 * h + 4 * nib + sub[None, :],
                         mask=ok[:, None], other=0).to(tl.int8, bitcast=True)
            w = d * sc.to(tl.float32)[:, :, None] * (q - 32).to(tl.float32)
            tl.store(out + 128 * h + 64 * nib, w.to(Out.dtype.element_ty), mask=ok[:, None, None])


@triton.jit
def _dequant_iq4_xs_kernel(W, Out, N, K, row_bytes, LEVELS, BLOCK_N: tl.constexpr):
    """Program (row tile, super-block)."""
    pid, sb = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    blk = W + rows.to(tl.int64) * row_bytes + sb * 136
    sub = tl.arange(0, 8)[None, :, None]
    j = tl.arange(0, 16)[None, None, :]
    q = tl.load(blk[:, None, None] + 8 + sub * 16 + j, mask=ok[:, None, None], other=0).to(tl.int32)
    scale = (_f16_at(blk, ok)[:, None] * _iq4_xs_scales(blk, ok))[:, :, None]
    out = Out + rows.to(tl.int64)[:, None, None] * K + sb * 256 + sub * 32 + j
    for half in tl.static_range(2):  # low nibbles: weights 0-15 of a sub-block; high: 16-31
        w = scale * tl.load(LEVELS + ((q >> (4 * half)) & 15))
        tl.store(out + 16 * half, w.to(Out.dtype.element_ty), mask=ok[:, None, None])


def _block32_bytes(ggml_type: int) -> tuple[int, int]:
    """A block of 32's bytes, and its codes' (all but the fp16 d): Q8_0 34, 32; Q4_0 18, 16."""
    size = FORMATS[ggml_type][1]
    return size, size - 2


def _levels_on(device: torch.device) -> torch.Tensor:
    if device not in _levels:
        _levels[device] = torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=device)
    return _levels[device]


def dequantize(blocks: torch.Tensor, ggml_type: int, n: int, k: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The [n, k] matrix of ``blocks`` in ``dtype`` (each weight rounded once from float32):
    a product of many rows multiplies this with the library's GEMM."""
    _check(blocks, ggml_type, n, k)
    out = torch.empty(n, k, dtype=dtype, device=blocks.device)
    block_n = 16
    args = (blocks, out, n, k, blocks.shape[1])
    if ggml_type in (Q4_0, Q8_0, Q8_0_SPLIT):  # blocks of 32, eight a program
        _dequant_q8_0_q4_0_kernel[(triton.cdiv(n, block_n), triton.cdiv(k // 32, 8))](
            *args, *_block32_bytes(ggml_type), BLOCK_N=block_n, GROUP=8,
            SPLIT=ggml_type == Q8_0_SPLIT)
        return out
    grid = (triton.cdiv(n, block_n), k // 256)  # super-blocks of 256, one a program
    if ggml_type == IQ4_XS:
        _dequant_iq4_xs_kernel[grid](*args, _levels_on(blocks.device), BLOCK_N=block_n)
    elif ggml_type in (Q6_K, Q6_K_PLANES):
        _dequant_q6_k_kernel[grid](*args, BLOCK_N=block_n, PLANES=ggml_type == Q6_K_PLANES)
    else:
        _dequant_q4_k_q5_k_kernel[grid](*args, FIVE=ggml_type == Q5_K, BLOCK_N=block_n)
    return out


def q6_k_planes(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """Q6_K ``blocks`` (uint8 [n, k / 256 * 210]) repacked into ``Q6_K_PLANES`` rows."""
    n = blocks.shape[0]
    b = blocks.reshape(n, k // 256, 210)
    return torch.cat([b[:, :, lo:hi].reshape(n, -1)
                      for lo, hi in ((0, 128), (128, 192), (192, 208), (208, 210))], dim=1)


def q8_0_split(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """Q8_0 ``blocks`` (uint8 [n, k / 32 * 34]) repacked into ``Q8_0_SPLIT`` rows."""
    if k % 64:
        raise ValueError(f"the split Q8_0 layout needs rows of a multiple of 64 weights, got {k}")
    n = blocks.shape[0]
    b = blocks.reshape(n, k // 32, 34)
    return torch.cat([b[:, :, 2:].reshape(n, k), b[:, :, :2].reshape(n, k // 16)], dim=1)


# held layout -> (the ggml type it repacks, the row lengths it takes: a multiple of this,
# so that its words stay 4-byte aligned, its repacking of [n, row_bytes] blocks and k)
REPACKED = {Q6_K_PLANES: (Q6_K, 512, q6_k_planes), Q8_0_SPLIT: (Q8_0, 64, q8_0_split)}


def _check(blocks: torch.Tensor, ggml_type: int, n: int, k: int) -> None:
    if ggml_type not in FORMATS:
        raise UnsupportedFeatureError(f"no GPU kernel reads GGUF type {ggml_type} blocks")
    per, size = FORMATS[ggml_type]
    if k % per or tuple(blocks.shape) != (n, k // per * size) or blocks.dtype != torch.uint8:
        raise ValueError(f"blocks {tuple(blocks.shape)} {blocks.dtype} do not hold a [{n}, {k}] "
                         f"matrix of type {ggml_type}")


# (rows a program, blocks or super-blocks of each row a loop step, warps) per type: the
# fastest on an H100 over Llama-3-8B's gate_up and down (.devrun's bench_gguf sweep,
# docs/benchmarks.md, session 26); each checked there against dequantize-then-matmul
CONFIGS = {Q8_0: (2, 16, 2), Q4_K: (4, 2, 2), Q6_K: (8, 8, 4), Q6_K_PLANES: (8, 8, 4),
           Q8_0_SPLIT: (2, 16, 2),
           # not tuned yet (Q8_0's and Q4_K's shapes; checked on an H100, session 34)
           Q4_0: (2, 16, 2), Q5_K: (4, 2, 2), IQ4_XS: (4, 2, 2)}


def block_gemv(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, n: int, k: int,
               out_dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None,
               config: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """x [M, k] (a few rows) @ W.T for W [n, k] stored as GGUF ``ggml_type`` blocks
    (``blocks``: uint8 [n, row_bytes]) -> [M, n] in ``out_dtype`` (default x's), or into
    ``out`` (a view of [M, n] with contiguous rows). ``config``: in place of
    ``CONFIGS``' (for tuning)."""
    _check(blocks, ggml_type, n, k)
    x = x.contiguous()
    y = out if out is not None else torch.empty(x.shape[0], n, dtype=out_dtype or x.dtype,
                                                device=x.device)
    if y.shape != (x.shape[0], n) or y.stride(1) != 1:
        raise ValueError(f"out {tuple(y.shape)} with strides {y.stride()} for [{x.shape[0]}, {n}]")
    block_n, depth, warps = config or CONFIGS[ggml_type]
    grid = (triton.cdiv(n, block_n), x.shape[0])
    args = (x, blocks, y, n, k, blocks.shape[1], x.stride(0), y.stride(0))
    tile = dict(BLOCK_N=block_n, DEPTH=depth, num_warps=warps)
    if ggml_type in (Q4_0, Q8_0, Q8_0_SPLIT):
        _q8_0_q4_0_kernel[grid](*args, *_block32_bytes(ggml_type), SPLIT=ggml_type == Q8_0_SPLIT,
                                **tile)
    elif ggml_type in (Q4_K, Q5_K):
        _q4_k_q5_k_kernel[grid](*args, FIVE=ggml_type == Q5_K, **tile)
    elif ggml_type in (Q6_K, Q6_K_PLANES):
        _q6_k_kernel[grid](*args, PLANES=ggml_type == Q6_K_PLANES, **tile)
    else:
        _iq4_xs_kernel[grid](*args, _levels_on(x.device), **tile)
    return y

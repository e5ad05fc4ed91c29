"""Attention for prefill and chunked prefill over the paged cache, variable lengths.

Reference: the prefill groups of ``layers.attention.TorchAttention`` (one SDPA
call per sequence, a dense mask when part of it is cached). Here one launch
serves every sequence of the step: sequence b's ``q_len[b]`` query rows start at
row ``q_start[b]`` and sit at positions ``seq_len[b] - q_len[b] ..`` of a
sequence whose K/V -- the earlier chunks and this chunk's own rows, written
first by ``kv_write`` -- are all read from the cache through its block table.
Query position p attends to key positions ``(p - window, p]`` (``window`` 0 =
``[0, p]``), flash-attention style (online softmax, fp32 accumulators). With ``sinks``
(gpt-oss), each head's sink logit starts the online softmax as a key of value zero: it
only joins the denominator.

One program = one block of BLOCK_M query rows x one query head of one sequence.
Only the key tiles that cross the causal diagonal, the window's edge or the end
of the sequence pay for a mask. An FP8 cache (``kv_fp8.py``) is read as the decode
kernel reads it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import kv_fp8
from .paged_decode_attention import _tanh


@triton.jit(do_not_specialize=["stride_bt"])  # the block-table width: see STEP_INTS
def _prefill_kernel(Q, K, V, KExp, VExp, Out, BlockTables, SeqLens, QStart, QLens, Sinks,
                    stride_qt, stride_qh, stride_kslot, stride_kh, stride_vslot, stride_vh,
                    stride_ot, stride_oh, stride_bt, stride_e,
                    scale, softcap, window,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, SINKS: tl.constexpr,
                    FP8: tl.constexpr):
    head = tl.program_id(0)
    seq = tl.program_id(2)
    q_len = tl.load(QLens + seq)
    m0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M  # longest rows first
    if m0 < q_len:
        seq_len = tl.load(SeqLens + seq)
        ctx = seq_len - q_len  # tokens cached before this chunk
        kv_head = head // GROUP
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q_pos = ctx + rows
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q_row = (tl.load(QStart + seq) + rows).to(tl.int64)
        q = tl.load(Q + q_row[:, None] * stride_qt + head * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        first_q = ctx + m0
        last_q = tl.minimum(ctx + m0 + BLOCK_M, seq_len) - 1
        # Key tiles start at multiples of BLOCK_N, whatever the chunk: a row then sums its
        # keys in the same tiles wherever its query tile starts (tiles before its window
        # are masked for it, and add exactly nothing).
        kv_lo = tl.where(window > 0, tl.maximum(first_q - window + 1, 0), 0) // BLOCK_N * BLOCK_N
        kv_hi = last_q + 1
        # Keys every row of the block may see: no mask needed there.
        safe_lo = tl.where(window > 0, tl.maximum(last_q - window + 1, 0), 0)
        safe_hi = first_q + 1
        if SINKS:  # the sink as a first key of weight exp(sink) and value zero
            m_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(Sinks + head) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = BlockTables + seq.to(tl.int64) * stride_bt
        qk_scale = scale * 1.4426950408889634  # exp2 domain
        for n0 in range(kv_lo, kv_hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            ok = pos < kv_hi
            page = tl.load(table + pos // PAGE, mask=ok, other=0).to(tl.int64)
            slot = page * PAGE + pos % PAGE
            kv_mask = ok[:, None] & dim_ok[None, :]
            k = tl.load(K + slot[:, None] * stride_kslot + kv_head * stride_kh + dims[None, :],
                        mask=kv_mask, other=0)
            if FP8:
                k = kv_fp8.decode(k, q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            if FP8:  # each key's scale on its column
                s = s * kv_fp8.scale_of(tl.load(KExp + slot * stride_e + kv_head, mask=ok,
                                                other=127))[None, :]
            if SOFTCAP:
                s = softcap * _tanh(s * (scale / softcap)) * 1.4426950408889634
            else:
                s = s * qk_scale
            if (n0 < safe_lo) | (n0 + BLOCK_N > safe_hi):
                allowed = (pos[None, :] <= q_pos[:, None]) & ok[None, :]
                allowed = allowed & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
                s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row masked so far
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slot[:, None] * stride_vslot + kv_head * stride_vh + dims[None, :],
                        mask=kv_mask, other=0)
            if FP8:  # each value's scale on its column of probabilities
                v = kv_fp8.decode(v, q.dtype)
                p = p * kv_fp8.scale_of(tl.load(VExp + slot * stride_e + kv_head, mask=ok,
                                                other=127))[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows may see no key
        tl.store(Out + q_row[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


# (BLOCK_M, BLOCK_N, warps, stages) by head_dim (up to 128, up to 256), tuned on an
# H200 (``bench --tune``); SMALL_TILES where the device lacks the shared memory.
TILES = {128: (64, 32, 4, 2), 256: (128, 64, 8, 3)}
SMALL_TILES = (64, 32, 4, 2)
# Batch-invariant mode: one tile for every row, decode or prefill (kernel_policy.py).
INVARIANT_TILES = (16, 64, 4, 2)
_too_big: set[int] = set()  # head-dim classes whose TILES did not fit on this device


def _dim_class(dim: int) -> int:
    return 128 if dim <= 128 else 256


def _tiles(dim: int, max_q_len: int) -> tuple[int, int, int, int]:
    """Short chunks get short query tiles (at least 16 rows, the dot's minimum)."""
    key = _dim_class(dim)
    block_m, block_n, warps, stages = (SMALL_TILES if key in _too_big or dim > 256
                                       else TILES[key])
    block_m = min(block_m, max(16, triton.next_power_of_2(max_q_len)))
    return block_m, block_n, warps if block_m >= 64 else 4, stages


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, q_start: torch.Tensor,
                      q_lens: torch.Tensor, max_q_len: int, block_size: int, scale: float,
                      window: Optional[int] = None, softcap: Optional[float] = None,
                      out: Optional[torch.Tensor] = None,
                      tiles: Optional[tuple[int, int, int, int]] = None,
                      sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of each sequence's chunk over its whole cached prefix.

    q: [T, H, D]; k/v_cache: [slots, Hkv, D] already holding this chunk's K/V;
    block_tables [B, W], seq_lens [B] (cached + chunk), q_start [B], q_lens [B], all int32;
    ``max_q_len`` = q_lens.max() known on the host. Writes the chunks' rows of ``out``.
    ``tiles`` overrides (BLOCK_M, BLOCK_N, warps, stages) for tests and tuning.
    ``sinks``: [H] float32 per-head logits joining each softmax's denominator (gpt-oss).
    """
    _, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    if out is None:
        out = torch.empty_like(q)
    num_seqs = block_tables.shape[0]
    if num_seqs == 0 or max_q_len == 0:
        return out
    args = (q, k_cache, v_cache, out, block_tables, seq_lens, q_start, q_lens, max_q_len,
            block_size, scale, window, softcap, sinks)
    try:
        _launch(*args, tiles or _tiles(dim, max_q_len))
    except OutOfResources:
        if tiles is not None or dim > 256 or _dim_class(dim) in _too_big:
            raise
        _too_big.add(_dim_class(dim))  # e.g. a GPU with less shared memory than an H200
        _launch(*args, _tiles(dim, max_q_len))
    return out


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, q_start: torch.Tensor,
            q_lens: torch.Tensor, max_q_len: int, block_size: int, scale: float,
            window: Optional[int], softcap: Optional[float], sinks: Optional[torch.Tensor],
            tiles: tuple[int, int, int, int]) -> None:
    heads, dim, kv_heads = q.shape[1], q.shape[2], k_cache.shape[1]
    block_m, block_n, warps, stages = tiles
    grid = (heads, triton.cdiv(max_q_len, block_m), block_tables.shape[0])
    fp8 = kv_fp8.is_fp8(k_cache)
    exps = (kv_fp8.exponents(k_cache), kv_fp8.exponents(v_cache)) if fp8 else (q, q)
    if fp8:
        k_cache, v_cache = kv_fp8.codes(k_cache), kv_fp8.codes(v_cache)
    _prefill_kernel[grid](
        q, k_cache, v_cache, *exps, out, block_tables, seq_lens, q_start, q_lens,
        q if sinks is None else sinks,  # unread without sinks
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), exps[0].stride(0), scale, softcap or 1.0, window or 0,
        GROUP=heads // kv_heads, HEAD_DIM=dim, PAGE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(dim),
        SOFTCAP=softcap is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SINKS=sinks is not None,
        FP8=fp8, num_warps=warps, num_stages=stages)

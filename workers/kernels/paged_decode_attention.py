"""Paged attention for decode: one query token per sequence over its cached K/V.

Reference: the decode group of ``layers.attention.TorchAttention`` (gather the
cache by block table, SDPA). Here one program serves one (sequence, KV head,
split) and all the query heads that share that KV head (GQA), so each K/V row is
read from memory once per step. When the batch is too small to fill the GPU
(few sequences x KV heads), each sequence's keys are cut into splits that run in
parallel, and the last split of each (sequence, KV head) to finish merges their
partial softmaxes (flash-decoding, with the merge in the same launch: an arrival
counter per pair tells a program it is the last).

Masking: a sequence of length L attends to positions ``[L - window, L)`` clamped
at 0 (``window`` 0 = full). Scores are ``scale * q.k``, optionally soft-capped
``softcap * tanh(s / softcap)`` before the softmax (Gemma 2 style). Sinks (gpt-oss: a
logit per query head in the denominator, no value) enter once: as the online softmax's
starting point when unsplit, else as the merge's (the splits' partials leave them out).
An FP8 cache (``kv_fp8.py``) is read as codes, each key's scale applied to its column of
scores and each value's to its column of probabilities.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from . import kv_fp8, pdl
from .pdl import wait_for_prior

# Launch shape, tuned on an H200 under CUDA graphs (``bench --tune`` sweeps them). A
# decode graph is captured for the longest context, so a small batch is split finely:
# splits past a sequence's length exit at once, and short splits keep each program's
# chain of dependent loads short (docs/benchmarks.md, "Batch-1 decode").
TILES = {128: (64, 4), 256: (64, 4)}  # by head_dim up to 128 / 256: (keys per loop, warps)


@triton.jit
def _tanh(x):
    # tanh from exp (no libdevice dependency, so it also runs under the interpreter);
    # |x| > 15 is +-1 in float32 anyway, and the clamp keeps exp finite.
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


# Ints that change from step to step are not specialized (Triton would otherwise compile a
# variant for each "== 1" / "divisible by 16" pattern of them, stalling the first steps that
# meet a new one); nothing in the kernels gains from knowing them.
STEP_INTS = ["stride_bt", "stride_pb", "stride_ph", "partition", "min_partition"]


@triton.jit(do_not_specialize=STEP_INTS)
def _decode_kernel(Q, K, V, KExp, VExp, Out, PartOut, PartLse, Counters, BlockTables,
                   SeqLens, QRows, KNew, VNew, Slots, Sinks,
                   stride_qt, stride_qh, stride_kslot, stride_kh, stride_vslot, stride_vh,
                   stride_ot, stride_oh, stride_bt, stride_pb, stride_ph, stride_ps,
                   stride_knt, stride_knh, stride_vnt, stride_vnh, stride_e,
                   scale, softcap, window, partition, min_partition,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   SOFTCAP: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                   WRITE_KV: tl.constexpr, BLOCK_G: tl.constexpr, MERGE_CHUNK: tl.constexpr,
                   SINKS: tl.constexpr, SHRINK: tl.constexpr, PDL: tl.constexpr,
                   FP8: tl.constexpr):
    # Before the wait (pdl.py) only the step's inputs are read: lengths, rows, tables.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    if SHRINK:  # this sequence's own splits: as short as min_partition allows, on the grid
        partition = tl.maximum(min_partition, tl.cdiv(tl.cdiv(seq_len - lo, tl.num_programs(2)),
                                                      BLOCK_N) * BLOCK_N)
    start = lo + split * partition
    if start < seq_len:  # a split past this sequence's end has nothing to do
        end = tl.minimum(seq_len, start + partition)
        heads = kv_head * GROUP + tl.arange(0, BLOCK_H)
        head_ok = tl.arange(0, BLOCK_H) < GROUP
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        row = tl.load(QRows + seq).to(tl.int64)
        table = BlockTables + seq.to(tl.int64) * stride_bt
        pos = start + tl.arange(0, BLOCK_N)
        if WRITE_KV:
            # The cache as it was before this launch: the first keys' tile is in flight before
            # the wait. The new rows this launch writes are taken from k/v_new, not read back.
            k, v, ks, vs, ok = _load_tile(K, V, KExp, VExp, table, pos, end, kv_head, dims,
                                          dim_ok, stride_kslot, stride_kh, stride_vslot,
                                          stride_vh, stride_e, PAGE, FP8)
            new_slot = tl.load(Slots + row)
        wait_for_prior(PDL)
        if not WRITE_KV:  # the kv_write launch before this one wrote the new rows
            k, v, ks, vs, ok = _load_tile(K, V, KExp, VExp, table, pos, end, kv_head, dims,
                                          dim_ok, stride_kslot, stride_kh, stride_vslot,
                                          stride_vh, stride_e, PAGE, FP8)
        q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                    mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
        if WRITE_KV:  # the split holding the new token stores its k/v (no kv_write launch)
            k_new = tl.load(KNew + row * stride_knt + kv_head * stride_knh + dims, mask=dim_ok,
                            other=0.0)
            v_new = tl.load(VNew + row * stride_vnt + kv_head * stride_vnh + dims, mask=dim_ok,
                            other=0.0)
            if FP8:  # the new rows as the cache will hold them: codes and a scale each
                ek_new = kv_fp8.exponent_of(tl.max(tl.abs(k_new.to(tl.float32)), 0))
                ev_new = kv_fp8.exponent_of(tl.max(tl.abs(v_new.to(tl.float32)), 0))
                k_new, v_new = kv_fp8.encode(k_new, ek_new), kv_fp8.encode(v_new, ev_new)
                if end == seq_len:
                    if new_slot >= 0:
                        tl.store(KExp + new_slot * stride_e + kv_head, ek_new.to(tl.uint8))
                        tl.store(VExp + new_slot * stride_e + kv_head, ev_new.to(tl.uint8))
            if end == seq_len:
                if new_slot >= 0:
                    tl.store(K + new_slot * stride_kslot + kv_head * stride_kh + dims, k_new,
                             mask=dim_ok)
                    tl.store(V + new_slot * stride_vslot + kv_head * stride_vh + dims, v_new,
                             mask=dim_ok)
            new = pos == seq_len - 1
            k = tl.where(new[:, None], k_new[None, :], k)
            v = tl.where(new[:, None], v_new[None, :], v)
            if FP8:
                ks = tl.where(new, kv_fp8.scale_of(ek_new), ks)
                vs = tl.where(new, kv_fp8.scale_of(ev_new), vs)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        if SINKS:
            if not SPLIT:  # the sink as a first key of value zero (split: in the merge)
                m_i = tl.load(Sinks + heads, mask=head_ok, other=0.0) * 1.4426950408889634
                l_i = tl.full([BLOCK_H], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        m_i, l_i, acc = _attend_tile(q, k, v, ks, vs, ok, m_i, l_i, acc, scale, softcap,
                                     SOFTCAP, PRECISION, FP8)
        for n0 in range(start + BLOCK_N, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            k, v, ks, vs, ok = _load_tile(K, V, KExp, VExp, table, pos, end, kv_head, dims,
                                          dim_ok, stride_kslot, stride_kh, stride_vslot,
                                          stride_vh, stride_e, PAGE, FP8)
            if WRITE_KV:
                new = pos == seq_len - 1
                k = tl.where(new[:, None], k_new[None, :], k)
                v = tl.where(new[:, None], v_new[None, :], v)
                if FP8:
                    ks = tl.where(new, kv_fp8.scale_of(ek_new), ks)
                    vs = tl.where(new, kv_fp8.scale_of(ev_new), vs)
            m_i, l_i, acc = _attend_tile(q, k, v, ks, vs, ok, m_i, l_i, acc, scale, softcap,
                                         SOFTCAP, PRECISION, FP8)
        out_mask = head_ok[:, None] & dim_ok[None, :]
        out_rows = Out + row * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        if SPLIT:
            used = tl.cdiv(seq_len - lo, partition)  # the splits that run for this sequence
            LONE: tl.constexpr = 1 - SINKS  # (with sinks even one split goes through the merge)
            if used <= LONE:  # the only split: its softmax is the whole row's
                tl.store(out_rows, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=out_mask)
            else:
                base = seq.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
                tl.store(PartOut + base[:, None] * HEAD_DIM + dims[None, :], acc / l_i[:, None],
                         mask=out_mask)
                tl.store(PartLse + base, m_i + tl.log2(l_i), mask=head_ok)
                # The last of this (sequence, KV head)'s splits to finish merges them all: a
                # counter per pair, released after the partials and reset by that last one.
                tl.debug_barrier()
                counter = Counters + seq * tl.num_programs(1) + kv_head
                if tl.atomic_add(counter, 1, sem="acq_rel") == used - 1:
                    tl.atomic_xchg(counter, 0)
                    _merge_splits(Out, PartOut, PartLse, Sinks, row, seq, kv_head, used,
                                  stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, GROUP,
                                  HEAD_DIM, BLOCK_G, MERGE_CHUNK, BLOCK_D, SINKS)
        else:
            tl.store(out_rows, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=out_mask)


@triton.jit
def _load_tile(K, V, KExp, VExp, table, pos, end, kv_head, dims, dim_ok, stride_kslot,
               stride_kh, stride_vslot, stride_vh, stride_e, PAGE: tl.constexpr,
               FP8: tl.constexpr):
    """The cached keys and values at positions ``pos`` (those before ``end``) of one KV
    head, and (FP8) each position's key and value scale (else ones)."""
    ok = pos < end
    page = tl.load(table + pos // PAGE, mask=ok, other=0).to(tl.int64)
    slot = page * PAGE + pos % PAGE
    kv_mask = ok[:, None] & dim_ok[None, :]
    k = tl.load(K + slot[:, None] * stride_kslot + kv_head * stride_kh + dims[None, :],
                mask=kv_mask, other=0)
    v = tl.load(V + slot[:, None] * stride_vslot + kv_head * stride_vh + dims[None, :],
                mask=kv_mask, other=0)
    if FP8:
        ks = kv_fp8.scale_of(tl.load(KExp + slot * stride_e + kv_head, mask=ok, other=127))
        vs = kv_fp8.scale_of(tl.load(VExp + slot * stride_e + kv_head, mask=ok, other=127))
    else:
        ks = tl.full(pos.shape, 1.0, tl.float32)
        vs = ks
    return k, v, ks, vs, ok


@triton.jit
def _attend_tile(q, k, v, ks, vs, ok, m_i, l_i, acc, scale, softcap, SOFTCAP: tl.constexpr,
                 PRECISION: tl.constexpr, FP8: tl.constexpr):
    """One tile of keys into the online softmax (m_i, l_i, acc), in the exp2 domain. FP8:
    k and v are e4m3 codes, ks and vs their positions' scales."""
    if FP8:
        k = kv_fp8.decode(k, q.dtype)
        v = kv_fp8.decode(v, q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if FP8:
        s = s * ks[None, :]
    if SOFTCAP:
        s = softcap * _tanh(s * (scale / softcap)) * 1.4426950408889634
    else:
        s = s * (scale * 1.4426950408889634)
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = p * vs[None, :] if FP8 else p
    acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _merge_splits(Out, PartOut, PartLse, Sinks, row, seq, kv_head, used, stride_ot, stride_oh,
                  stride_pb, stride_ph, stride_ps, GROUP: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    """The output rows of this KV head's query heads from their splits' partial softmaxes,
    all heads at once (online over chunks of splits). Loads skip L1: other programs wrote
    the partials."""
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    head_base = seq.to(tl.int64) * stride_pb + heads * stride_ph
    mx = tl.full([BLOCK_G], -1e30, tl.float32)  # finite: padded heads stay NaN-free
    den = tl.zeros([BLOCK_G], tl.float32)
    if SINKS:  # a partial of lse = sink and output zero
        mx = tl.where(g_ok, tl.load(Sinks + heads, mask=g_ok, other=0.0) * 1.4426950408889634,
                      mx)
        den = tl.where(g_ok, 1.0, den)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s0 in range(0, used, CHUNK):
        splits = s0 + tl.arange(0, CHUNK)
        ok = g_ok[:, None] & (splits < used)[None, :]
        at = head_base[:, None] + splits[None, :] * stride_ps
        lse = tl.load(PartLse + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(PartOut + at[:, :, None] * HEAD_DIM + dims[None, None, :],
                       mask=ok[:, :, None] & dim_ok[None, None, :], other=0.0,
                       cache_modifier=".cg")
        new_mx = tl.maximum(mx, tl.max(lse, 1))
        rescale = tl.exp2(mx - new_mx)
        weights = tl.exp2(lse - new_mx[:, None])
        den = den * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.sum(part * weights[:, :, None], 1)
        mx = new_mx
    tl.store(Out + row * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             (acc / den[:, None]).to(Out.dtype.element_ty),
             mask=g_ok[:, None] & dim_ok[None, :])


_counters: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device, needed: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, one per (sequence, KV head) of a split launch; each
    launch leaves them zero again. Kept per device, so a CUDA graph replays over the same
    ones (the warm-up before capture allocates them: splits happen below one program per
    multiprocessor, so this size rarely grows)."""
    have = _counters.get(device)
    if have is None or have.numel() < needed:
        have = _counters[device] = torch.zeros(max(needed, 1024), dtype=torch.int32,
                                               device=device)
    return have


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The multiprocessors a launch can fill (4 under the CPU interpreter)."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 4


def decode_tiles(head_dim: int, element_size: int) -> tuple[int, int]:
    """(keys per loop, warps) of the decode kernel for a cache of ``element_size``-byte
    values: a split is a multiple of the keys. Float32 caches of heads wider than 128 take
    half the keys (64 keys of 256-wide float32 heads need 272 KB of shared memory)."""
    block_n, warps = TILES[128 if head_dim <= 128 else 256]
    return (block_n // 2 if element_size == 4 and head_dim > 128 else block_n), warps


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           q_rows: torch.Tensor, max_seq_len: int, block_size: int,
                           scale: float, window: Optional[int] = None,
                           softcap: Optional[float] = None, out: Optional[torch.Tensor] = None,
                           partition: Optional[int] = None, min_partition: Optional[int] = None,
                           tiles: Optional[tuple[int, int]] = None,
                           new_kv: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of one query row per sequence over its paged cache.

    q: [T, H, D] (rows ``q_rows[b]`` are sequence b's query); k/v_cache: [slots, Hkv, D]
    with slot = block * block_size + offset; block_tables: [B, W] int32; seq_lens: [B]
    int32 (the query is the last position); ``max_seq_len`` is seq_lens.max() known on
    the host. Writes rows ``q_rows`` of ``out`` ([T, H, D], allocated if None).
    ``partition``: keys per split (the kernel policy's ``decode_partition``); None: one
    split of the whole span. ``min_partition``: the partition only sizes the grid (a
    graph's, for its longest context), and each sequence cuts its own keys into as many
    of its splits as keep each at least this long: a short sequence in a graph captured
    for long ones runs several short splits, not one long one. ``tiles`` overrides
    (BLOCK_N, warps), for tuning. ``new_kv`` = (k, v, slot_mapping), k/v
    [T, Hkv, D]: write each sequence's new k/v row (at ``q_rows``) into its slot first,
    as ``kv_write.write_kv`` would (negative slots are skipped); the cache need not
    hold that position yet. ``sinks``: [H] float32 per-head logits joining each
    softmax's denominator (gpt-oss).
    """
    _, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    if out is None:
        out = torch.empty_like(q)
    num_seqs = block_tables.shape[0]
    if num_seqs == 0:
        return out
    group = heads // kv_heads
    span = max_seq_len if not window else min(max_seq_len, window)
    block_n, warps = tiles or decode_tiles(dim, k_cache.element_size())
    if partition is None:
        partition = max(span, 1)
    num_splits = triton.cdiv(span, partition)
    split = num_splits > 1
    if split:
        part_out = torch.empty(num_seqs, heads, num_splits, dim, device=q.device,
                               dtype=torch.float32)
        part_lse = torch.empty(num_seqs, heads, num_splits, device=q.device, dtype=torch.float32)
        counters = _split_counters(q.device, num_seqs * kv_heads)
    else:
        part_out = part_lse = counters = out  # unused
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    block_d = triton.next_power_of_2(dim)
    k_new, v_new, slots = new_kv if new_kv is not None else (q, q, q_rows)
    fp8 = kv_fp8.is_fp8(k_cache)
    exps = (kv_fp8.exponents(k_cache), kv_fp8.exponents(v_cache)) if fp8 else (q, q)
    if fp8:
        k_cache, v_cache = kv_fp8.codes(k_cache), kv_fp8.codes(v_cache)
    _decode_kernel[(num_seqs, kv_heads, num_splits)](
        q, k_cache, v_cache, *exps, out, part_out, part_lse, counters, block_tables, seq_lens,
        q_rows,
        k_new, v_new, slots, q if sinks is None else sinks,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), heads * num_splits, num_splits, 1,
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        exps[0].stride(0), scale, softcap or 1.0, window or 0, partition, min_partition or 0,
        GROUP=group, HEAD_DIM=dim, PAGE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        SOFTCAP=softcap is not None, SPLIT=split, PRECISION=precision,
        WRITE_KV=new_kv is not None, BLOCK_G=triton.next_power_of_2(group),
        MERGE_CHUNK=min(8, triton.next_power_of_2(num_splits)), SINKS=sinks is not None,
        SHRINK=split and min_partition is not None, FP8=fp8, num_warps=warps,
        **pdl.launch_options(q.device))
    return out

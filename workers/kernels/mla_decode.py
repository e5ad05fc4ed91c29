"""Decode attention of multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged
latent cache, in the absorbed form.

Each cache slot holds one token's latent ``c`` (R = kv_lora_rank values) followed by its
rotary key ``k_r`` (P = qk_rope_head_dim values), shared by all H query heads (MQA with
one KV head). Head h of sequence b scores position j as
``scale * (q_latent[h] . c_j + q_rope[h] . k_r_j)`` and returns ``softmax @ c``, a row of
R values (the caller applies W_UV).

Layout of the work: one program serves one block of BLOCK_H heads of one sequence over
one split of its keys. Every head reads the same cache rows, so a program loads each
tile of rows once and feeds it to both products (scores against ``c``, then the output
from the same ``c``), and the programs of one sequence's head blocks are adjacent in the
grid (axis 0), so at H=128 the repeated reads of a tile come from L2. A sequence's keys
are cut into splits of ``partition`` keys (flash-decoding) so a small batch still
fills the GPU; each split leaves its normalized partial row and log-sum-exp, and a
second launch over (sequence, head, slice of R) merges them. Unlike
``paged_decode_attention``, the merge is not done by the last split to arrive: a split's
partial here is BLOCK_H x R floats (16 x 512, where a GQA head group's is a few rows of
128), so one program merging all of a sequence's splits would be the critical path;
spread over (sequence, head, R/64) programs it is short. ``mla_partition`` picks the
keys per split through the kernel policy. docs/gpu_kernels.md has the design, its
numbers and the roofline; ``bench_mla`` measures it.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .paged_decode_attention import sm_count

# Launch shape (heads per program, keys per loop, warps, pipeline stages); not yet tuned
# on the device (``bench_mla --tune`` sweeps them). 16 heads is the smallest tile tl.dot
# takes; its float32 accumulator of 16 x 512 is 64 registers a thread at 4 warps. Every
# head block reads every cache tile, so at H=128 each row crosses from L2 into the SMs
# H / BLOCK_H times: 32 heads a program (8 warps, the same accumulator registers a
# thread) halves the 8x that 16 would cost (docs/gpu_kernels.md).
SMALL_H_TILE = (16, 32, 4, 2)
LARGE_H_TILE = (32, 32, 8, 2)
FLOAT32_TILE = (16, 16, 4, 1)  # a float32 tile of 32 x 512 keys is twice the bytes
# The merge: latent values per program (B1 x H16 gives 128 programs) and splits per loop
# (a B1 x 32k sequence has 512 splits: 16 dependent loads of L2 latency, not 64).
MERGE_BLOCK_R = 64
MERGE_CHUNK = 32
# A split's partial (H x R float32 values) should not outweigh the cache rows it read
# (keys x (R + P) elements): keys per split at least PARTIAL_TRAFFIC times H*R*4 bytes
# over a row's bytes (at H=128, R=512, bf16: 228 keys). At batch 1 the partials stay in L2.
PARTIAL_TRAFFIC = 1

# Ints that change from step to step are not specialized (see paged_decode_attention).
STEP_INTS = ["stride_bt", "partition", "num_splits"]
MERGE_STEP_INTS = ["partition", "num_splits"]


@triton.jit(do_not_specialize=STEP_INTS)
def _mla_split_kernel(QLat, QRope, Cache, Out, PartOut, PartLse, BlockTables, SeqLens, QRows,
                      stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_cs,
                      stride_ot, stride_oh, stride_bt, scale, partition, num_splits,
                      HEADS: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
                      PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    head_block = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
    start = split * partition
    if start < seq_len:  # a split past this sequence's end has nothing to do
        end = tl.minimum(seq_len, start + partition)
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < HEADS
        lat = tl.arange(0, R)
        rope = tl.arange(0, P)
        row = tl.load(QRows + seq).to(tl.int64)
        q_lat = tl.load(QLat + row * stride_qlt + heads[:, None] * stride_qlh + lat[None, :],
                        mask=head_ok[:, None], other=0.0)
        q_rope = tl.load(QRope + row * stride_qrt + heads[:, None] * stride_qrh + rope[None, :],
                         mask=head_ok[:, None], other=0.0)
        if UPCAST:  # the interpreter's tl.dot is wrong on bfloat16 (numpy has none)
            q_lat = q_lat.to(tl.float32)
            q_rope = q_rope.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, R], tl.float32)
        table = BlockTables + seq.to(tl.int64) * stride_bt
        qk_scale = scale * 1.4426950408889634  # exp2 domain
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            ok = pos < end
            page = tl.load(table + pos // PAGE, mask=ok, other=0).to(tl.int64)
            slot_row = Cache + (page * PAGE + pos % PAGE) * stride_cs
            c = tl.load(slot_row[:, None] + lat[None, :], mask=ok[:, None], other=0.0)
            k_r = tl.load(slot_row[:, None] + R + rope[None, :], mask=ok[:, None], other=0.0)
            if UPCAST:
                c = c.to(tl.float32)
                k_r = k_r.to(tl.float32)
            s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
            s = tl.dot(q_rope, tl.trans(k_r), acc=s, input_precision=PRECISION)
            s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
            m_i = m_new
        acc = acc / l_i[:, None]
        if SPLIT:  # partials [B, H, splits, R] and their log2-sum-exp [B, H, splits]
            at = (seq.to(tl.int64) * HEADS + heads) * num_splits + split
            tl.store(PartOut + at[:, None] * R + lat[None, :], acc, mask=head_ok[:, None])
            tl.store(PartLse + at, m_i + tl.log2(l_i), mask=head_ok)
        else:
            tl.store(Out + row * stride_ot + heads[:, None] * stride_oh + lat[None, :],
                     acc.to(Out.dtype.element_ty), mask=head_ok[:, None])


@triton.jit(do_not_specialize=MERGE_STEP_INTS)
def _mla_merge_kernel(Out, PartOut, PartLse, SeqLens, QRows, stride_ot, stride_oh, partition,
                      num_splits, HEADS: tl.constexpr, R: tl.constexpr,
                      BLOCK_R: tl.constexpr, CHUNK: tl.constexpr):
    """One head's slice of BLOCK_R latent values from its splits' partial softmaxes,
    online over chunks of splits."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    lat = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    used = tl.cdiv(tl.load(SeqLens + seq), partition)  # the splits that ran
    base = (seq.to(tl.int64) * HEADS + head) * num_splits
    mx = tl.max(tl.full([CHUNK], -1e30, tl.float32), 0)  # finite: no inf - inf
    den = tl.max(tl.zeros([CHUNK], tl.float32), 0)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for s0 in range(0, used, CHUNK):
        splits = s0 + tl.arange(0, CHUNK)
        ok = splits < used
        lse = tl.load(PartLse + base + splits, mask=ok, other=float("-inf"))
        part = tl.load(PartOut + (base + splits)[:, None] * R + lat[None, :], mask=ok[:, None],
                       other=0.0)
        new_mx = tl.maximum(mx, tl.max(lse, 0))
        rescale = tl.exp2(mx - new_mx)
        weights = tl.exp2(lse - new_mx)
        den = den * rescale + tl.sum(weights, 0)
        acc = acc * rescale + tl.sum(part * weights[:, None], 0)
        mx = new_mx
    row = tl.load(QRows + seq).to(tl.int64)
    tl.store(Out + row * stride_ot + head * stride_oh + lat, (acc / den).to(Out.dtype.element_ty))


def default_tiles(heads: int, element_size: int) -> tuple[int, int, int, int]:
    if element_size == 4:
        return FLOAT32_TILE
    return LARGE_H_TILE if heads >= 32 else SMALL_H_TILE


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def fits_widths(rank: int, rope: int) -> bool:
    """Whether latent rows of ``rank + rope`` take this kernel: whole power-of-two tiles."""
    return all(w >= 16 and w & (w - 1) == 0 for w in (rank, rope))


def _check(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
           block_tables: torch.Tensor, out: Optional[torch.Tensor]) -> tuple[int, int, int]:
    if q_latent.dim() != 3 or q_rope.dim() != 3 or cache.dim() != 2:
        raise ValueError(f"expected q_latent [T, H, R], q_rope [T, H, P], cache [slots, R+P]; "
                         f"got {tuple(q_latent.shape)}, {tuple(q_rope.shape)}, "
                         f"{tuple(cache.shape)}")
    tokens, heads, rank = q_latent.shape
    rope = q_rope.shape[2]
    if not fits_widths(rank, rope):
        raise ValueError(f"mla_decode_attention: kv_lora_rank R = {rank} and qk_rope_head_dim "
                         f"P = {rope} must be powers of two >= 16 (the kernel's tiles)")
    if q_rope.shape[:2] != (tokens, heads):
        raise ValueError(f"q_rope {tuple(q_rope.shape)} does not match q_latent "
                         f"{tuple(q_latent.shape)} in tokens/heads")
    if cache.shape[1] != rank + rope:
        raise ValueError(f"cache rows hold {cache.shape[1]} values, not R + P = {rank + rope}")
    if not q_latent.dtype == q_rope.dtype == cache.dtype:
        raise ValueError(f"q_latent, q_rope and cache must share a dtype; got {q_latent.dtype}, "
                         f"{q_rope.dtype}, {cache.dtype}")
    if q_latent.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"mla_decode_attention takes float32/float16/bfloat16, not "
                         f"{q_latent.dtype}")
    if out is not None and out.shape != q_latent.shape:
        raise ValueError(f"out {tuple(out.shape)} is not q_latent's {tuple(q_latent.shape)}")
    for name, t in (("q_latent", q_latent), ("q_rope", q_rope), ("cache", cache), ("out", out),
                    ("block_tables", block_tables)):
        if t is not None and t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    return heads, rank, rope


def mla_decode_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         q_rows: torch.Tensor, max_seq_len: int, block_size: int, scale: float,
                         out: Optional[torch.Tensor] = None, partition: Optional[int] = None,
                         tiles: Optional[tuple[int, int, int, int]] = None) -> torch.Tensor:
    """Absorbed MLA decode of one query row per sequence over the paged latent cache.

    q_latent [T, H, R] (already through W_UK), q_rope [T, H, P]; cache [slots, R + P]
    with slot = block_tables[b, pos // block_size] * block_size + pos % block_size;
    block_tables [B, W] int32; seq_lens [B] int32: sequence b attends to positions
    [0, seq_lens[b]) (at least 1, its own token being cached already; a 0 leaves its
    row unwritten or NaN); q_rows [B]: its row
    of q_latent/q_rope/out; ``max_seq_len`` = seq_lens.max(), known on the host. Writes
    rows ``q_rows`` of ``out`` ([T, H, R], allocated with q's dtype if None) with
    softmax(scale * (q_latent . c + q_rope . k_r)) @ c, accumulated in float32.
    ``partition``: keys per split (``mla_partition``); None: one split of the whole span.
    ``tiles`` overrides (BLOCK_H, BLOCK_N, warps, stages), for tuning.
    """
    heads, rank, rope = _check(q_latent, q_rope, cache, block_tables, out)
    if out is None:
        out = torch.empty_like(q_latent)
    num_seqs = block_tables.shape[0]
    if num_seqs == 0:
        return out
    block_h, block_n, warps, stages = tiles or default_tiles(heads, cache.element_size())
    if partition is None:
        partition = max(max_seq_len, 1)
    if partition < 1:
        raise ValueError(f"partition must be a positive number of keys, got {partition}")
    num_splits = triton.cdiv(max(max_seq_len, 1), partition)
    split = num_splits > 1
    if split:
        part_out = torch.empty(num_seqs, heads, num_splits, rank, device=out.device,
                               dtype=torch.float32)
        part_lse = torch.empty(num_seqs, heads, num_splits, device=out.device,
                               dtype=torch.float32)
    else:
        part_out = part_lse = out  # unused
    grid = (triton.cdiv(heads, block_h), num_seqs, num_splits)
    _mla_split_kernel[grid](
        q_latent, q_rope, cache, out, part_out, part_lse, block_tables, seq_lens, q_rows,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        cache.stride(0), out.stride(0), out.stride(1), block_tables.stride(0),
        scale, partition, num_splits,
        HEADS=heads, R=rank, P=rope, PAGE=block_size, BLOCK_H=block_h, BLOCK_N=block_n,
        SPLIT=split, PRECISION="ieee" if cache.dtype == torch.float32 else "tf32",
        UPCAST=_interpreting() and cache.dtype == torch.bfloat16,
        num_warps=warps, num_stages=stages)
    if split:
        block_r = min(rank, MERGE_BLOCK_R)
        _mla_merge_kernel[(num_seqs, heads, rank // block_r)](
            out, part_out, part_lse, seq_lens, q_rows, out.stride(0), out.stride(1),
            partition, num_splits, HEADS=heads, R=rank, BLOCK_R=block_r,
            CHUNK=min(MERGE_CHUNK, triton.next_power_of_2(num_splits)), num_warps=4,
            num_stages=2)
    return out


def mla_partition(policy, num_seqs: int, heads: int, span: int, rank: int, rope: int,
                  element_size: int, device: torch.device,
                  block_h: Optional[int] = None) -> int:
    """Keys per split for a decode launch of this kernel: the kernel policy's
    ``decode_partition`` with a sequence's head blocks as its "KV heads" (each is one
    program per split), raised so a split's float32 partial (H x R) is no more than
    1/PARTIAL_TRAFFIC of the cache bytes it read; a whole number of ``BLOCK_N`` loops."""
    tile_h, block_n, _, _ = default_tiles(heads, element_size)
    head_blocks = triton.cdiv(heads, block_h or tile_h)
    part = policy.decode_partition(num_seqs, head_blocks, span, sm_count(device), block_n)
    floor = PARTIAL_TRAFFIC * heads * rank * 4 // ((rank + rope) * element_size)
    floor = triton.cdiv(max(floor, 1), block_n) * block_n
    return min(max(part, floor), max(span, 1))


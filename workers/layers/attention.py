"""Attention over a paged KV cache: per-step metadata and the torch reference backend.

The KV cache of a layer is a flat tensor of slots ``[num_blocks * block_size, kv_heads,
head_dim]``; a token at position ``p`` of a sequence lives in slot
``block_ids[p // block_size] * block_size + p % block_size``.

``build_metadata`` runs once per step, on the host, and computes every index
and mask the layers need (slots to write, slots to gather, masks per window
size), so the layer loop does no Python bookkeeping. A faster backend (Triton,
GPU) only has to implement ``AttentionBackend.forward`` over the same metadata.
With ``kernel_tables=True`` it holds, instead of the per-group gathers and masks,
block tables and lengths as int32 tensors (``PagedSeqs``) that the Triton
kernels read (``workers/kernels``).
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from ..step_rows import ScheduledSeq
from ..device import to_device


@dataclass
class KVView:
    """Which keys a group of queries reads, for one window size."""

    gather: Optional[torch.Tensor]  # [B, Lk] cache slots; None: the step's own fresh k/v rows
    mask: Optional[torch.Tensor]  # [B, 1, Q, Lk] bool, True = attend; None: see ``causal``
    causal: bool  # no mask: plain causal (Q == Lk) or nothing to mask (a lone decode)
    lengths: Optional[torch.Tensor] = None  # decodes: [B] int64 keys each reads (gather's first)


@dataclass
class AttentionGroup:
    """Queries attended in one SDPA call: one prefill chunk, or every decode token."""

    rows: Union[slice, torch.Tensor]  # rows of the flattened batch
    batch: int
    q_len: int
    views: dict[Optional[int], KVView]  # by window size (None = full attention)


@dataclass
class PagedSeqs:
    """Sequences of one kind (decodes, or prefill chunks) as the Triton kernels read them."""

    block_tables: torch.Tensor  # [B, W] int32; padded with block 0, never read past seq_lens
    seq_lens: torch.Tensor  # [B] int32: cached tokens once this step's are written
    q_start: torch.Tensor  # [B] int32: the sequence's first row in the flattened batch
    q_lens: torch.Tensor  # [B] int32: its rows this step
    max_seq_len: int  # host copies of the maxima: grid sizes without a device sync
    max_q_len: int
    lone_fresh_rows: Optional[slice] = None  # the rows of a lone sequence starting at 0
    host: tuple[tuple[int, int, int], ...] = ()  # per sequence: (q_start, q_len, seq_len)
    # A speculative step's rows run as decodes (each row a position of its sequence, its
    # own length; verify_graphs.py): the sequences they belong to (0: each row its own)
    num_seqs: int = 0
    # what a layer derives from these once a step for every layer (mla.py's key slots)
    memo: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    groups: list[AttentionGroup]  # empty when built with kernel_tables=True
    num_tokens: int
    covers_all_rows: bool  # a single group holding every row, in order
    block_size: int = 0
    decode: Optional[PagedSeqs] = None  # kernel_tables=True: the one-token sequences
    prefill: Optional[PagedSeqs] = None  # kernel_tables=True: the others


def build_metadata(seqs: Sequence[ScheduledSeq], block_size: int,
                   windows: Sequence[Optional[int]], device: torch.device,
                   pad_slot: int, kernel_tables: bool = False,
                   rows_as_decodes: bool = False) -> AttentionMetadata:
    """``pad_slot``: a slot that always holds zeros, read by the padding of batched decodes
    (masked out, but it must not hold NaN garbage, since 0 * NaN is NaN).
    ``kernel_tables``: build the Triton kernels' tables instead of the torch groups;
    ``rows_as_decodes`` (with them): every row of a sequence as a decode of its own
    position (a speculative step verified as decodes: verify_graphs.py)."""
    if kernel_tables:
        if not rows_as_decodes:
            return _kernel_metadata(seqs, block_size, device)
        rows = [ScheduledSeq(s.block_ids, s.start + j, 1, s.row + j)
                for s in seqs for j in range(s.num_tokens)]
        meta = _kernel_metadata(rows, block_size, device)
        if meta.decode is not None:
            meta.decode.num_seqs = len(seqs)
        return meta
    if rows_as_decodes:
        raise ValueError("rows run as decodes only on the Triton kernels' tables")
    windows = sorted(set(windows), key=lambda w: -1 if w is None else w)
    slots: list[np.ndarray] = []
    groups: list[AttentionGroup] = []
    decodes: list[ScheduledSeq] = []
    for seq in seqs:
        table = np.asarray(seq.block_ids, dtype=np.int64)
        slots.append(_slots(table, np.arange(seq.start, seq.start + seq.num_tokens), block_size))
        if seq.num_tokens == 1:
            decodes.append(seq)
        else:
            groups.append(_prefill_group(seq, table, block_size, windows, device))
    if decodes:
        groups.append(_decode_group(decodes, block_size, windows, device, pad_slot))
    num_tokens = sum(s.num_tokens for s in seqs)
    only = groups[0].rows if len(groups) == 1 else None
    covers_all = isinstance(only, slice) and only.start == 0 and only.stop == num_tokens
    slot_mapping = np.concatenate(slots) if slots else np.empty(0, dtype=np.int64)
    return AttentionMetadata(_host(slot_mapping, device), groups, num_tokens, covers_all)


ALIGN_INTS = 4  # int32s per 16 bytes


def _kernel_metadata(seqs: Sequence[ScheduledSeq], block_size: int,
                     device: torch.device) -> AttentionMetadata:
    """Every int the kernels need, packed on the host into one int32 buffer and sent
    to the device in one copy (no per-sequence tensors, no masks)."""
    flat: list[int] = []
    for seq in seqs:  # slot mapping: one range per block touched, not one op per token
        pos, end = seq.start, seq.start + seq.num_tokens
        while pos < end:
            block, offset = divmod(pos, block_size)
            take = min(block_size - offset, end - pos)
            base = seq.block_ids[block] * block_size + offset
            flat.extend(range(base, base + take))
            pos += take
    num_tokens = len(flat)
    kinds = ([s for s in seqs if s.num_tokens == 1], [s for s in seqs if s.num_tokens > 1])
    widths = []

    def align() -> None:
        # Every section starts 16-byte aligned: Triton compiles a kernel variant per
        # pointer alignment, and a step-dependent one meant new compiles mid-serving.
        flat.extend([0] * (-len(flat) % ALIGN_INTS))

    for kind in kinds:  # per kind: seq_lens, q_start, q_lens, then the [B, W] block table
        width = max((-(-(s.start + s.num_tokens) // block_size) for s in kind), default=0)
        widths.append(width)
        for values in ([s.start + s.num_tokens for s in kind], [s.row for s in kind],
                       [s.num_tokens for s in kind]):
            align()
            flat.extend(values)
        align()
        for s in kind:
            table = s.block_ids[:width]
            flat.extend(table)
            flat.extend([0] * (width - len(table)))
    # array -> frombuffer is ~4x faster than torch.tensor(list) for a long list
    packed = torch.frombuffer(array.array("i", flat), dtype=torch.int32) if flat else \
        torch.empty(0, dtype=torch.int32)
    packed = packed.clone() if device.type == "cpu" else to_device(packed, device)
    meta = AttentionMetadata(packed[:num_tokens], [], num_tokens, False, block_size)
    at = num_tokens
    for name, kind, width in zip(("decode", "prefill"), kinds, widths):
        b = len(kind)
        sections = []
        for size in (b, b, b, b * width):  # as packed above, each from an aligned start
            at += -at % ALIGN_INTS
            sections.append(packed[at:at + size])
            at += size
        if not kind:
            continue
        lens, starts, q_lens, tables = sections
        tables = tables.view(b, width)
        lone = kind[0] if len(kind) == 1 and kind[0].start == 0 else None
        setattr(meta, name, PagedSeqs(tables, lens, starts, q_lens,
                                      max(s.start + s.num_tokens for s in kind),
                                      max(s.num_tokens for s in kind),
                                      slice(lone.row, lone.row + lone.num_tokens) if lone
                                      else None,
                                      tuple((s.row, s.num_tokens, s.start + s.num_tokens)
                                            for s in kind)))
    return meta


# The index arithmetic runs in numpy: a step's metadata is a few dozen small operations,
# and each costs ~1 us there against ~10 us as a torch op (a CPU decode step spent ~0.6 ms
# of its ~18 here).
def _host(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(torch.from_numpy(np.ascontiguousarray(a)), device)


def _slots(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    return table[positions // block_size] * block_size + positions % block_size


def _prefill_group(seq: ScheduledSeq, table: np.ndarray, block_size: int,
                   windows: Sequence[Optional[int]], device: torch.device) -> AttentionGroup:
    n, end = seq.num_tokens, seq.start + seq.num_tokens
    q_pos = np.arange(seq.start, end)
    views = {}
    for window in windows:
        lo = 0 if window is None else max(0, seq.start - window + 1)
        if seq.start == 0 and (window is None or n <= window):
            views[window] = KVView(None, None, True)  # fresh rows, plain causal
            continue
        kv_pos = np.arange(lo, end)
        mask = kv_pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - window
        gather = None if seq.start == 0 else _host(_slots(table, kv_pos, block_size)[None], device)
        views[window] = KVView(gather, _host(mask[None, None], device), False)
    return AttentionGroup(slice(seq.row, seq.row + n), 1, n, views)


def _decode_group(seqs: Sequence[ScheduledSeq], block_size: int,
                  windows: Sequence[Optional[int]], device: torch.device,
                  pad_slot: int) -> AttentionGroup:
    # Each decode token attends to the last min(len, window) positions of its sequence;
    # sequences are padded to the longest and the padding is masked out.
    lengths = np.array([s.start + 1 for s in seqs], dtype=np.int64)
    width = max(len(s.block_ids) for s in seqs)
    tables = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        tables[i, :len(s.block_ids)] = s.block_ids
    rows = np.arange(len(seqs))[:, None]
    views = {}
    for window in windows:
        counts = lengths if window is None else np.minimum(lengths, window)
        lk = int(counts.max())
        offs = np.arange(lk)[None, :]
        kv_pos = lengths[:, None] - counts[:, None] + offs
        valid = offs < counts[:, None]
        kv_pos = np.where(valid, kv_pos, 0)
        gather = tables[rows, kv_pos // block_size] * block_size + kv_pos % block_size
        gather = np.where(valid, gather, pad_slot)
        uniform = bool((counts == lk).all())
        mask = None if uniform else _host(valid[:, None, None, :], device)
        views[window] = KVView(_host(gather, device), mask, uniform, _host(counts, device))
    return AttentionGroup(_rows([s.row for s in seqs], device), len(seqs), 1, views)


def _rows(rows: list[int], device: torch.device) -> Union[slice, torch.Tensor]:
    """A slice when the rows are consecutive (no gather/scatter copy), else an index."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return to_device(rows, device)


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                window: Optional[int], scale: float, softcap: Optional[float],
                out: Optional[torch.Tensor] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]; writes k/v into the cache first.
        ``out``: a [T, H, D] tensor to write the result into (and return).
        ``sinks``: [H] float32 logits (gpt-oss), one per query head, that join each
        softmax's denominator with no value: the row is scaled by
        ``sum(exp(s)) / (sum(exp(s)) + exp(sink))``."""


class TorchAttention:
    """Reference backend: gather each group's K/V from the cache, then SDPA (GQA-aware)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                window: Optional[int], scale: float, softcap: Optional[float],
                out: Optional[torch.Tensor] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        if out is not None:
            return out.copy_(self.forward(q, k, v, k_cache, v_cache, meta, window, scale,
                                          softcap, sinks=sinks))
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = None if meta.covers_all_rows else torch.empty_like(q)
        for group in meta.groups:
            og = self.attend_group(q, k, v, k_cache, v_cache, group, group.views[window],
                                   scale, softcap, sinks)
            if out is None:
                return og
            if isinstance(group.rows, slice):
                out[group.rows] = og
            else:
                out.index_copy_(0, group.rows, og)
        return out

    def attend_group(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup,
                     view: KVView, scale: float, softcap: Optional[float],
                     sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One group's attention rows [rows, H, D] (its k/v already in the cache)."""
        qg = _take(q, group.rows).view(group.batch, group.q_len, *q.shape[1:]).transpose(1, 2)
        if view.gather is None:
            kg, vg = _take(k, group.rows).unsqueeze(0), _take(v, group.rows).unsqueeze(0)
        else:  # index_select on the flat index: far cheaper than advanced indexing
            shape = (*view.gather.shape, *k.shape[1:])
            flat = view.gather.view(-1)
            kg = k_cache.index_select(0, flat).view(shape)
            vg = v_cache.index_select(0, flat).view(shape)
        kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)  # [B, Hkv, Lk, D]
        causal = view.causal and group.q_len > 1
        if softcap is None and sinks is None:
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=view.mask,
                                                is_causal=causal, scale=scale, enable_gqa=True)
        else:
            og = _explicit_attention(qg, kg, vg, view.mask, causal, scale, softcap, sinks)
        return og.transpose(1, 2).reshape(-1, *q.shape[1:])


def _take(x: torch.Tensor, rows: Union[slice, torch.Tensor]) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: Optional[torch.Tensor], causal: bool, scale: float,
                        softcap: Optional[float], sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Scores in float32 for what SDPA cannot express: tanh-capped scores (Gemma 2 style)
    and attention sinks (gpt-oss: a per-head logit in the softmax, its value dropped)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        q_len, k_len = scores.shape[-2:]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)

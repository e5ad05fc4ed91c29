"""TritonAttention: the ``AttentionBackend`` of the GPU path.

Per layer and step: one kv_write launch, then one paged-decode launch for the
one-token sequences (it merges its own splits) and one prefill launch for the
chunks; each writes its own rows of the output. A step of decodes alone skips the
kv_write launch: the decode kernel writes each sequence's new k/v row itself. It reads
the metadata that ``build_metadata(..., kernel_tables=True)`` builds (see
``kernel_tables``).

One exception, measured: a lone long prompt computed from position 0 (no cached
prefix, no window cutting it, no soft-cap, no sinks) goes to PyTorch's SDPA on the
step's own k/v rows, whose flash kernel beats the Triton one there (docs/benchmarks.md).
Attention sinks (gpt-oss) are in both Triton kernels (``sinks=``).

Batch-invariant mode (``kernel_policy.py``): every row, decode or prefill, runs the
prefill kernel with one fixed tile (``INVARIANT_TILES``), after one kv_write: the
decode kernel's split count and SDPA both depend on the step's other sequences.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..layers.attention import AttentionMetadata
from .kv_write import write_kv
from .paged_decode_attention import decode_tiles, paged_decode_attention, sm_count
from .prefill_attention import INVARIANT_TILES, prefill_attention


class TritonAttention:
    # The runner passes this to build_metadata: these kernels read block tables, not groups.
    kernel_tables = True
    # A verification step's rows can run as decodes (build_metadata's rows_as_decodes)
    rows_as_decodes = True

    def __init__(self, policy=None):
        """``policy``: the ``KernelPolicy`` that chooses decode splits, SDPA for a lone
        fresh prompt, and the batch-invariant mode (None: the default mode's)."""
        from ..kernel_policy import KernelPolicy

        self.policy = policy or KernelPolicy(triton=True)
        self.batch_invariant = self.policy.batch_invariant

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                window: Optional[int], scale: float, softcap: Optional[float],
                out: Optional[torch.Tensor] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]; writes k/v into the cache first.
        ``out``: a [T, H, D] tensor to write the result into (and return); ``sinks``:
        [H] float32 per-head logits in each softmax's denominator (gpt-oss)."""
        if out is None:
            out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        if meta.decode is None and meta.prefill is None:
            if meta.num_tokens:
                raise ValueError("TritonAttention needs build_metadata(..., kernel_tables=True)")
            return out
        p = meta.prefill
        if self.batch_invariant:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            for seqs in (meta.decode, p):
                if seqs is not None:
                    prefill_attention(q, k_cache, v_cache, seqs.block_tables, seqs.seq_lens,
                                      seqs.q_start, seqs.q_lens, seqs.max_q_len,
                                      meta.block_size, scale, window, softcap, out,
                                      tiles=INVARIANT_TILES, sinks=sinks)
            return out
        d = meta.decode
        # A decode-only step's rows are all decodes: the decode kernel writes them, unless
        # rows of one sequence read each other's (a speculative step run as decodes).
        fused_write = p is None and d is not None and not d.num_seqs
        if not fused_write:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if d is not None:
            span = min(d.max_seq_len, window) if window else d.max_seq_len
            # splits sized by sequences, not rows: a speculative row then splits its keys as
            # its decode would have, and sums them in the same order
            partition = self.policy.decode_partition(d.num_seqs or d.block_tables.shape[0],
                                                     k_cache.shape[1], span, sm_count(q.device),
                                                     decode_tiles(q.shape[2],
                                                                  k_cache.element_size())[0])
            paged_decode_attention(q, k_cache, v_cache, d.block_tables, d.seq_lens, d.q_start,
                                   d.max_seq_len, meta.block_size, scale, window, softcap, out,
                                   partition=partition,
                                   min_partition=self.policy.decode_min_partition,
                                   new_kv=(k, v, meta.slot_mapping) if fused_write else None,
                                   sinks=sinks)
        rows = p.lone_fresh_rows if p is not None else None
        if (rows is not None and softcap is None and sinks is None
                and (window is None or window >= p.max_q_len)
                and self.policy.fresh_prefill_on_sdpa(p.max_q_len, q.shape[2])):
            out[rows] = _sdpa_causal(q[rows], k[rows], v[rows], scale)
        elif p is not None:
            prefill_attention(q, k_cache, v_cache, p.block_tables, p.seq_lens, p.q_start,
                              p.q_lens, p.max_q_len, meta.block_size, scale, window, softcap,
                              out, sinks=sinks)
        return out

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                pad_block: int, block_size: int,
                layer_kinds: set[tuple[Optional[int], Optional[float]]], scale: float,
                sinks: bool = False, dtype: Optional[torch.dtype] = None) -> None:
        """Compile, before serving, each kernel variant a step can meet (Triton compiles
        one on first use, seconds the first requests would wait): every prefill query
        tile, SDPA's fresh path, and decode with and without its k/v write, unsplit and
        each merge width. Scratch rows of zeros, in and out of the zero padding block
        only. ``layer_kinds``: the (window, softcap) pairs of the model's layers;
        ``sinks``: its layers have attention sinks (the kernels' sink variants); ``dtype``:
        the model's (default: the cache's; an FP8 cache's model dtype differs)."""
        device, dtype = k_cache.device, dtype or k_cache.dtype
        kv_heads, dim = k_cache.shape[1], k_cache.shape[2]

        def rows(n: int, heads: int) -> torch.Tensor:
            return torch.zeros(n, heads, dim, device=device, dtype=dtype)

        def tables(n: int, length: int) -> torch.Tensor:
            width = -(-length // block_size)
            return torch.full((n, width), pad_block, dtype=torch.int32, device=device)

        def ints(*values: int) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        zero_sinks = torch.zeros(num_heads, device=device) if sinks else None

        if self.batch_invariant:  # one tile for every row
            for window, softcap in layer_kinds:
                prefill_attention(rows(16, num_heads), k_cache, v_cache, tables(1, 16), ints(16),
                                  ints(0), ints(16), 16, block_size, scale, window, softcap,
                                  tiles=INVARIANT_TILES, sinks=zero_sinks)
            return
        for window, softcap in layer_kinds:
            for length in (16, 32, 64, 128):  # each query tile height
                prefill_attention(rows(length, num_heads), k_cache, v_cache, tables(1, length),
                                  ints(length), ints(0), ints(length), length, block_size,
                                  scale, window, softcap, sinks=zero_sinks)
            k = rows(4, kv_heads)
            slots = torch.full((4,), pad_block * block_size, dtype=torch.int32, device=device)
            for splits in (1, 2, 4, 8):  # unsplit, then each merge chunk width
                for new_kv in ((k, k, slots), None):
                    paged_decode_attention(rows(4, num_heads), k_cache, v_cache,
                                           tables(4, 8 * splits), ints(*[8 * splits] * 4),
                                           ints(0, 1, 2, 3), 8 * splits, block_size, scale,
                                           window, softcap, partition=8, new_kv=new_kv,
                                           sinks=zero_sinks)
        shortest = self.policy.sdpa_min_rows[0 if dim <= 128 else 1]
        for length in (shortest, 2 * shortest, 4 * shortest) if shortest < 1 << 20 else ():
            _sdpa_causal(rows(length, num_heads), rows(length, kv_heads), rows(length, kv_heads),
                         scale)


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention of one sequence's rows: [L, H, D] in, [L, H, D] out."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0),
                                         k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0),
                                         is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)

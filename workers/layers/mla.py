"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

Each position caches one row per layer, ``[latent (kv_lora_rank) | k_rope
(qk_rope_head_dim)]``: the RMS-normed compressed KV and the rotated rope key that every
head shares (``CacheSpec("mla")``, kv_cache.py). Per head, ``kv_b_proj`` expands the
latent c into the key's no-rope part ``W_UK c`` and the value ``W_UV c``.

* **Prefill** rows expand k/v for every key of their sequence (gathered from the cache,
  so a chunk after a prefix hit or an earlier chunk reads the cached positions too) and
  attend as ordinary multi-head attention.
* **Decode** rows use the absorbed form: the query's no-rope part is folded into the
  latent space, ``q_latent = q_nope W_UK`` [H, R], so the scores are
  ``q_latent . c + q_rope . k_rope`` over the cached rows themselves; the output stays in
  latent space and ``W_UV`` is applied after. ``mla_decode_attention`` below is the torch
  form; the kernel policy picks it or a Triton kernel of the same signature
  (``KernelPolicy.mla_decode``).

Rope: DeepSeek checkpoints lay their rope dimensions out in (even, odd) pairs (V2
always, V3 unless ``rope_interleave`` is false). The loader permutes those rows of
``q_proj``/``q_b_proj`` and ``kv_a_proj_with_mqa`` into the rotate-half layout
(``deinterleave_rope``), so a plain rotary runs here; q and k are permuted alike, so
every score is unchanged and the cache holds rotate-half rope keys.

Both paths read block tables (``AttentionMetadata`` built with ``kernel_tables=True``,
on every device), so the decode and piecewise CUDA graphs capture MLA models as any other.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..device import to_device
from ..distributed import SINGLE, TPGroup
from ..kernel_policy import rows_alone
from ..kernels import fused_kernel
from .attention import AttentionMetadata, PagedSeqs
from .linear import ColumnParallelLinear, RowParallelLinear, Shard, even_shard
from .norm import RMSNorm
from .rotary import apply_rotary

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon
# (not the config's rms_norm_eps)
LATENT_NORM_EPS = 1e-6


def mla_decode_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         q_rows: torch.Tensor, max_seq_len: int, block_size: int,
                         scale: float, out: Optional[torch.Tensor] = None,
                         num_seqs: int = 0) -> torch.Tensor:
    """One query per sequence over its cached latent rows (the torch reference).

    q_latent [T, H, R], q_rope [T, H, P]; cache [slots, R + P]; block_tables [B, W]
    int32; seq_lens [B] int32 (keys of sequence b, its query the last of them); q_rows
    [B] int64 (sequence b's row of q). Returns ``out`` [T, H, R] (allocated when None:
    rows not in q_rows are zero), the softmax-weighted sum of the latents. ``num_seqs``
    sizes the Triton kernel's key splits (``KernelPolicy.mla_decode``); this form reads
    each row's keys whole, so it takes it only to share that signature."""
    rank = q_latent.shape[-1]
    batch = block_tables.shape[0]
    pos = torch.arange(max_seq_len, device=cache.device)
    slots = (block_tables.long()[:, pos // block_size] * block_size + pos % block_size)
    valid = pos[None, :] < seq_lens.long()[:, None]  # [B, L]
    # Past a sequence's end the table may name any block (padding): read its position 0
    # instead, always written and finite, and mask it out.
    slots = torch.where(valid, slots, slots[:, :1])
    keys = cache.index_select(0, slots.view(-1)).view(batch, max_seq_len, -1)  # [B, L, R+P]
    q = torch.cat((q_latent.index_select(0, q_rows), q_rope.index_select(0, q_rows)), dim=-1)
    scores = torch.matmul(q, keys.transpose(1, 2)) * scale  # [B, H, L]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    latent = torch.matmul(probs, keys[..., :rank])  # [B, H, R]
    if out is None:
        out = q_latent.new_zeros(q_latent.shape)
    return out.index_copy_(0, q_rows, latent)


def mla_prefill_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                          seqs: PagedSeqs, block_size: int, scale: float,
                          expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                          out: torch.Tensor) -> None:
    """Prefill chunks: each sequence's queries over all its keys, expanded from the
    cached latents (its own chunk included, written before). q_nope [T, H, N], q_rope
    [T, H, P]; ``expand(latent [L, R]) -> (k_nope [L, H, N], v [L, H, V])``; writes the
    chunk's rows of ``out`` [T, H, V]. The keys of a run of sequences are gathered and
    expanded at once (one product, not one per sequence); each sequence then attends."""
    rank = cache.shape[-1] - q_rope.shape[-1]
    q = torch.cat((q_nope, q_rope), dim=-1)
    for members, slots in key_runs(seqs, block_size):
        rows = cache.index_select(0, slots)
        k_nope, v = expand(rows[:, :rank])
        k = torch.cat((k_nope, rows[:, None, rank:].expand(-1, k_nope.shape[1], -1)), dim=-1)
        at = 0
        for start, count, length in members:
            qs = q[start:start + count].transpose(0, 1)  # [H, Q, N+P]
            ks, vs = k[at:at + length].transpose(0, 1), v[at:at + length].transpose(0, 1)
            if count == length:  # a fresh prompt: plain causal
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
            else:  # query i is position length - count + i: it reads keys up to there
                pos = torch.arange(length, device=q.device)
                mask = pos[None, :] <= pos[length - count:, None]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            out[start:start + count] = o.transpose(0, 1)
            at += length


MAX_RUN_KEYS = 1 << 16  # keys expanded at once: bounds the run's k/v ([keys, H, N+P+V])


def key_runs(seqs: PagedSeqs, block_size: int) -> list[tuple[tuple, torch.Tensor]]:
    """The prefill sequences in runs of at most ``MAX_RUN_KEYS`` keys (a longer sequence
    alone), each with the cache slots of all its keys in order. Built from the host's
    lengths (no device sync) once a step, and kept for the other layers."""
    runs = seqs.memo.get("mla_key_runs")
    if runs is not None:
        return runs
    if len(seqs.host) != seqs.block_tables.shape[0]:
        raise ValueError("MLA prefill needs the sequences' host lengths (PagedSeqs.host)")
    groups: list[list[int]] = []
    keys = 0
    for b, (_, _, length) in enumerate(seqs.host):
        if not groups or keys + length > MAX_RUN_KEYS:
            groups.append([])
            keys = 0
        groups[-1].append(b)
        keys += length
    runs, device = [], seqs.block_tables.device
    for group in groups:
        which: list[int] = []  # per key: its sequence, and its position there
        pos: list[int] = []
        for b in group:
            length = seqs.host[b][2]
            which.extend([b] * length)
            pos.extend(range(length))
        which_t, pos_t = to_device(which, device, torch.long), to_device(pos, device, torch.long)
        slots = seqs.block_tables[which_t, pos_t // block_size].long() * block_size \
            + pos_t % block_size
        runs.append((tuple(seqs.host[b] for b in group), slots))
    seqs.memo["mla_key_runs"] = runs
    return runs


class MlaBackend:
    """What the runner needs from an MLA model's attention: block-table metadata on every
    device (``kernel_tables``). Decode steps replay whole CUDA graphs; a prefill's
    attention (which reads its sequences' lengths on the host) runs eagerly between the
    piecewise graphs, as every family's does. A speculative verification's rows run as
    decodes (``rows_as_decodes``: each row absorbed, its keys split as its decode step's),
    so verification steps replay the verify graphs (verify_graphs.py)."""

    kernel_tables = True
    rows_as_decodes = True

    def __init__(self, decode: Callable[..., torch.Tensor]):
        self.decode = decode  # KernelPolicy.mla_decode()


def _heads_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm`` of per-head rows [H, T, K] and matrices [H, K, N]. Inside
    ``rows_as_alone`` (a verification's rows) one row at a time: the library picks its
    kernel by the row count, so only that gives each row its decode step's bits."""
    if a.shape[1] == 1 or not rows_alone():
        return torch.bmm(a, b)
    return torch.cat([torch.bmm(a[:, i:i + 1], b) for i in range(a.shape[1])], dim=1)


def deinterleave_rope(weight: torch.Tensor, row_group: int, rope: int) -> torch.Tensor:
    """Rows [..., row_group * k, in]: in each group of ``row_group`` rows, the last
    ``rope`` rows reordered from (even, odd) pairs to halves (even ones, then odd ones):
    what turns DeepSeek's interleaved rotary into rotate-half."""
    groups = weight.reshape(-1, row_group, *weight.shape[1:])
    head, tail = groups[:, :row_group - rope], groups[:, row_group - rope:]
    return torch.cat((head, tail[:, 0::2], tail[:, 1::2]), dim=1).reshape(weight.shape)


class MLAttention(nn.Module):
    """One layer's MLA: heads split across ranks (q and kv_b column-parallel by head,
    o_proj row-parallel); the latent projection and its norm replicated, so every rank
    caches the same latent rows."""

    def __init__(self, hidden_size: int, num_heads: int, spec, scale: float,
                 backend: MlaBackend, device: torch.device, dtype: torch.dtype,
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.spec, self.scale, self.backend = spec, scale, backend
        self.num_heads = num_heads // tp.world
        n, p, v = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        latent = Shard(0, 0, spec.latent_width, spec.latent_width)  # replicated
        q_heads = even_shard(num_heads * (n + p), tp)
        if spec.q_lora_rank is None:
            # one product for q (this rank's heads) and the latent
            self.a_proj = ColumnParallelLinear(hidden_size, [q_heads, latent], False, device, dtype)
            self.q_a_layernorm = self.q_b_proj = None
        else:
            q_a = Shard(0, 0, spec.q_lora_rank, spec.q_lora_rank)
            self.a_proj = ColumnParallelLinear(hidden_size, [q_a, latent], False, device, dtype)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, LATENT_NORM_EPS, device)
            self.q_b_proj = ColumnParallelLinear(spec.q_lora_rank, [q_heads], False, device, dtype)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, LATENT_NORM_EPS, device)
        self.kv_b_proj = ColumnParallelLinear(spec.kv_lora_rank,
                                              [even_shard(num_heads * (n + v), tp)], False,
                                              device, dtype)
        self.o_proj = RowParallelLinear(even_shard(num_heads * v, tp, dim=1), hidden_size, False,
                                        device, dtype, tp)
        self.split = [self.a_proj.out_sizes[0], spec.latent_width]
        self.rotary_kernel = fused_kernel(device, "rotary", "apply_rotary_qk")
        self.output_shape = (self.num_heads, v)  # of each token's row ``attend`` writes

    def project(self, norm: RMSNorm, x: torch.Tensor, residual: Optional[torch.Tensor],
                rope: tuple[torch.Tensor, torch.Tensor]):
        """-> (q_nope [T, H, N], q_rope [T, H, P] rotated, the cache rows [T, R + P]),
        and the new residual."""
        s = self.spec
        a, residual = self.a_proj.normed(norm, x, residual)
        q, kv = a.split(self.split, dim=-1)
        if self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(x.shape[0], self.num_heads, s.qk_nope_head_dim + s.qk_rope_head_dim)
        q_nope, q_rope = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        latent, k_rope = kv.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        k_rope = k_rope.unsqueeze(1)
        if self.rotary_kernel is not None:  # both in place, one launch
            q_rope, k_rope = self.rotary_kernel(q_rope, k_rope, *rope)
        else:
            q_rope, k_rope = apply_rotary(q_rope, *rope), apply_rotary(k_rope, *rope)
        rows = torch.cat((self.kv_a_layernorm(latent), k_rope.squeeze(1)), dim=-1)
        return q_nope, q_rope, rows, residual

    def _kv_b(self) -> torch.Tensor:
        """kv_b_proj per head: [H, N + V, R] (W_UK rows, then W_UV rows)."""
        s = self.spec
        return self.kv_b_proj.weight.view(self.num_heads, s.qk_nope_head_dim + s.v_head_dim,
                                          s.kv_lora_rank)

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        kv = self.kv_b_proj(latent).view(latent.shape[0], self.num_heads, -1)
        return kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)

    def attend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor,
               meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, None],
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write the rows into the cache and attend: [T, H, V] (into ``out`` when given)."""
        cache = kv_cache[0]
        cache.index_copy_(0, meta.slot_mapping.long(), rows)
        tokens, s = q_nope.shape[0], self.spec
        if out is None:
            out = q_nope.new_empty(tokens, self.num_heads, s.v_head_dim)
        if meta.decode is not None:
            self._decode(q_nope, q_rope, cache, meta, out)
        if meta.prefill is not None:
            mla_prefill_attention(q_nope, q_rope, cache, meta.prefill, meta.block_size,
                                  self.scale, self._expand, out)
        return out

    def _decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, out: torch.Tensor) -> None:
        d, s = meta.decode, self.spec
        rows = d.q_start.long()
        if meta.prefill is None:  # every row decodes: q as it is
            q_rows = rows
        else:  # only the decode rows absorb
            q_nope, q_rope = q_nope.index_select(0, rows), q_rope.index_select(0, rows)
            q_rows = torch.arange(rows.shape[0], device=rows.device)
        kv_b = self._kv_b()
        w_uk, w_uv = kv_b[:, :s.qk_nope_head_dim], kv_b[:, s.qk_nope_head_dim:]
        # [H, T, N] @ [H, N, R] -> the queries in latent space
        q_latent = _heads_bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1).contiguous()
        latent = self.backend.decode(q_latent, q_rope.contiguous(), cache, d.block_tables,
                                     d.seq_lens, q_rows, d.max_seq_len, meta.block_size,
                                     self.scale, num_seqs=d.num_seqs)
        latent = latent.index_select(0, q_rows)  # [B, H, R]
        # [H, B, R] @ [H, R, V] -> each head's value
        values = _heads_bmm(latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        out.index_copy_(0, rows, values)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn.reshape(attn.shape[0], -1))

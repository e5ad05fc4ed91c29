"""Gated DeltaNet as a decoder layer's token mixer (Qwen3.5, Qwen3-Next): the projections,
the causal convolution and the delta rule (``gated_delta.py``) over per-sequence states
held in the worker's state pools (``kv_cache.PagedKVCache``, a ``CacheSpec("state")``
group: one slot per running request, the scheduler's ``kv_groups``).

A step's one-token sequences (decodes) update their states together, batched; each
longer chunk (a prompt, or a chunk of one) runs the chunked form from its slot's state, so
a prompt split across steps at any token computes what one step does. A slot whose
request starts at position 0 is zeroed by the runner before the step.

The mixer follows the segment protocol of ``models/base.Attention``: ``project`` (the
fused input projection, norm and residual add included), ``attend`` (the recurrent part,
reading and writing the state), ``output`` (the out projection).

Tensor parallelism splits the heads: each rank holds ``num_k_heads / world`` query/key
heads and the value heads that read them, so the state never crosses ranks; the out
projection is row-parallel.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import nn

from .. import kernels
from ..device import to_device
from ..distributed import SINGLE, TPGroup
from ..step_rows import ScheduledSeq
from . import gated_delta
from .gated_delta import causal_conv_varlen, conv_step, decay_and_beta, gated_rms_norm
from .linear import ColumnParallelLinear, RowParallelLinear, Shard, even_shard
from .norm import RMSNorm

Rows = Union[slice, torch.Tensor]
logger = logging.getLogger("pocketllm.worker")


class PrefillRound:
    """One round of a step's prompt chunks, each (first row, rows, slot), laid end to end
    (``gated_delta.Segments``), with the row and slot indices every layer gathers by,
    built once a step and copied without waiting for the stream."""

    def __init__(self, chunks: Sequence[tuple[int, int, int]], device: torch.device):
        self.chunks = tuple(chunks)
        starts, rows = [0], []
        for row, n, _slot in chunks:
            starts.append(starts[-1] + n)
            rows += range(row, row + n)
        self.segments = gated_delta.Segments(starts, device)
        first = chunks[0][0]
        self.rows: Rows = (slice(first, first + len(rows))
                           if rows == list(range(first, first + len(rows)))
                           else to_device(rows, device, torch.long))
        self.slots = to_device([slot for *_, slot in chunks], device, torch.long)
        # pieces of one row (a verification's rows, each snapshotted): the decode form
        self.single = all(n == 1 for _row, n, _slot in chunks)

    @classmethod
    def one_row_each(cls, rows: torch.Tensor, slots: torch.Tensor) -> "PrefillRound":
        """A round of one row a sequence, its rows and slots given on the device (a
        verify graph's buffers: verify_graphs.py)."""
        round_ = cls.__new__(cls)
        round_.chunks, round_.segments, round_.single = (), None, True
        round_.rows, round_.slots = rows, slots
        return round_


@dataclass
class StateMetadata:
    """A step's sequences as the recurrent layers read them."""

    decode_rows: Optional[Rows]  # rows of the one-token sequences (None: none)
    decode_slots: Optional[torch.Tensor]  # [B] their slots
    # The longer chunks in rounds: a chunk cut where a snapshot is taken runs its pieces
    # in successive rounds.
    prefills: tuple[PrefillRound, ...]
    # (round after which, its slot, the snapshot's slot): -1 after the decodes; the slots
    # are ints, or [B] tensors of a round's sequences (a verify graph's: pad slots where
    # a sequence takes none)
    snapshots: tuple[tuple[int, Union[int, torch.Tensor], Union[int, torch.Tensor]], ...] = ()
    # some rows are in no round (a verify graph's padding): their outputs must be finite
    padded: bool = False


def build_state_metadata(seqs: Sequence[ScheduledSeq], device: torch.device,
                         snapshots: Sequence[tuple[int, int]] = ()) -> StateMetadata:
    """``seqs``: the state group's view of the step (each table is one slot);
    ``snapshots``: (row, snapshot slot) of the plan's state snapshots in this group
    (``step_rows.snapshot_rows``)."""
    decodes = [s for s in seqs if s.num_tokens == 1]
    rows: Optional[Rows] = None
    slots = None
    if decodes:
        first = decodes[0].row
        if [s.row for s in decodes] == list(range(first, first + len(decodes))):
            rows = slice(first, first + len(decodes))
        else:
            rows = to_device([s.row for s in decodes], device)
        slots = to_device([s.block_ids[0] for s in decodes], device)
    taken = dict(snapshots)
    rounds: list[list[tuple[int, int, int]]] = []
    after = []
    for s in seqs:
        slot = s.block_ids[0]
        if s.num_tokens == 1:
            if s.row in taken:
                after.append((-1, slot, taken[s.row]))
            continue
        start, piece = s.row, 0
        for r in range(s.row, s.row + s.num_tokens):  # pieces ending at snapshotted rows
            if r in taken or r == s.row + s.num_tokens - 1:
                if piece == len(rounds):
                    rounds.append([])
                rounds[piece].append((start, r + 1 - start, slot))
                if r in taken:
                    after.append((piece, slot, taken[r]))
                start, piece = r + 1, piece + 1
    return StateMetadata(rows, slots, tuple(PrefillRound(r, device) for r in rounds),
                         tuple(after))


@functools.lru_cache(maxsize=None)
def _triton_forms():
    """The delta rule's forms on CUDA: flash-linear-attention's Triton kernels (a
    dependency on Linux x86_64); without it, the torch forms, said once."""
    try:
        return importlib.import_module(f"{kernels.__name__}.gated_delta")
    except ImportError as e:
        logger.warning("flash-linear-attention (fla-core) cannot be imported (%s): the "
                       "linear-attention layers run their torch forms on the GPU, slower", e)
        return gated_delta


def _take(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer: ``in_proj`` stacks this rank's q, k, v, z (the output
    gate), b (write strength) and a (decay) rows, in that order."""

    def __init__(self, hidden_size: int, spec, eps: float, device: torch.device,
                 dtype: torch.dtype, tp: TPGroup = SINGLE):
        super().__init__()
        self.spec, self.tp, self.eps = spec, tp, eps
        self.k_heads = spec.num_k_heads // tp.world
        self.v_heads = spec.num_v_heads // tp.world
        self.k_dim, self.v_dim = spec.k_head_dim, spec.v_head_dim
        key, value = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.channels = 2 * key + value  # the convolution's: q, k, v
        self.widths = [self.channels, value, self.v_heads, self.v_heads]
        self.in_proj = ColumnParallelLinear(hidden_size, [Shard(0, 0, n, n) for n in self.widths],
                                            False, device, dtype)
        self.conv_weight = nn.Parameter(torch.empty(self.channels, spec.conv_kernel,
                                                    device=device, dtype=dtype),
                                        requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.v_heads, device=device), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads, device=device), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.empty(self.v_dim, device=device, dtype=dtype),
                                        requires_grad=False)
        self.out_proj = RowParallelLinear(even_shard(spec.num_v_heads * self.v_dim, tp, dim=1),
                                          hidden_size, False, device, dtype, tp)
        forms = _triton_forms() if kernels.kernels_usable(device) else gated_delta
        self.chunked_varlen, self.decode_step = forms.chunked_varlen, forms.decode_step
        # a decode step in two launches on CUDA (kernels/gated_delta_decode.py); its tiles
        # need power-of-two head widths
        pow2 = all(d & (d - 1) == 0 for d in (self.k_dim, self.v_dim))
        self.fused_decode = (kernels.fused_kernel(device, "gated_delta_decode", "decode")
                             if pow2 else None)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's conv state (model dtype) and recurrent state (float32)."""
        return ((self.channels, self.spec.conv_kernel - 1),
                (self.v_heads, self.k_dim, self.v_dim))

    # ------------------------------------------------------------------ forward

    def project(self, norm: RMSNorm, x: torch.Tensor, residual: Optional[torch.Tensor],
                rope=None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the stacked projection of ``norm(x + residual)``, and the new residual."""
        return self.in_proj.normed(norm, x, residual)

    def attend(self, proj: torch.Tensor, meta: StateMetadata,
               cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The recurrent part, reading and writing each sequence's slot in ``cache`` (conv
        states [slots, channels, kernel - 1], states [slots, v_heads, k_dim, v_dim]):
        -> gated, normed outputs [T, v_heads * v_dim]."""
        conv_states, states = cache
        if not meta.prefills and meta.decode_rows == slice(0, proj.shape[0]):
            # only decodes, every row in order: their outputs are the layer's (no copy)
            normed = self._decode(proj, conv_states, states, meta.decode_slots)
            self._snapshot(meta, -1, conv_states, states)
            return normed
        normed = (torch.zeros if meta.padded else torch.empty)(
            proj.shape[0], self.v_heads * self.v_dim, dtype=proj.dtype, device=proj.device)
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            o = self._decode(_take(proj, rows), conv_states, states, meta.decode_slots)
            if isinstance(rows, slice):
                normed[rows] = o
            else:
                normed.index_copy_(0, rows, o)
        self._snapshot(meta, -1, conv_states, states)
        for i, round_ in enumerate(meta.prefills):
            self._prefill(proj, round_, conv_states, states, normed)
            self._snapshot(meta, i, conv_states, states)
        return normed

    @staticmethod
    def _snapshot(meta: StateMetadata, after: int, conv_states: torch.Tensor,
                  states: torch.Tensor) -> None:
        """This layer's share of the snapshots taken once round ``after`` is done."""
        for when, slot, snapshot in meta.snapshots:
            if when != after:
                continue
            if isinstance(slot, int):
                conv_states[snapshot].copy_(conv_states[slot])
                states[snapshot].copy_(states[slot])
            else:
                conv_states.index_copy_(0, snapshot, conv_states.index_select(0, slot))
                states.index_copy_(0, snapshot, states.index_select(0, slot))

    def _prefill(self, proj: torch.Tensor, round_: PrefillRound, conv_states: torch.Tensor,
                 states: torch.Tensor, normed: torch.Tensor) -> None:
        """Every chunk of more than one token at once, laid end to end: one convolution,
        the chunk form over them (``chunked_varlen``), one norm. A round of one-row
        pieces takes the decode form, so that a verified row has its decode step's bits
        (the chunk kernels add in another order)."""
        if round_.single:
            out = self._decode(_take(proj, round_.rows), conv_states, states, round_.slots)
        else:
            out = self._chunks(proj, round_, conv_states, states)
        if isinstance(round_.rows, slice):
            normed[round_.rows] = out
        else:
            normed.index_copy_(0, round_.rows, out)

    def _chunks(self, proj: torch.Tensor, round_: PrefillRound, conv_states: torch.Tensor,
                states: torch.Tensor) -> torch.Tensor:
        seg, slots = round_.segments, round_.slots
        mixed, z, b, a = _take(proj, round_.rows).split(self.widths, dim=-1)
        y, conv_new = causal_conv_varlen(mixed, self.conv_weight,
                                         conv_states.index_select(0, slots), seg)
        conv_states.index_copy_(0, slots, conv_new.to(conv_states.dtype))
        g, beta = decay_and_beta(a, b, self.A_log, self.dt_bias)
        core, final = self.chunked_varlen(*self._heads(y), g, beta,
                                          states.index_select(0, slots), seg)
        states.index_copy_(0, slots, final)
        return self._norm(core, z)

    def _decode(self, proj: torch.Tensor, conv_states: torch.Tensor, states: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
        """One token of each of B sequences (their stacked projections [B, ...])."""
        if self.fused_decode is not None:
            return self.fused_decode(proj, self.widths, self.conv_weight, conv_states, states,
                                     slots, self.A_log, self.dt_bias, self.norm_weight,
                                     self.k_heads, self.k_dim, self.eps)
        mixed, z, b, a = proj.split(self.widths, dim=-1)
        y, conv_new = conv_step(mixed, self.conv_weight, conv_states.index_select(0, slots))
        conv_states.index_copy_(0, slots, conv_new)
        g, beta = decay_and_beta(a, b, self.A_log, self.dt_bias)
        core, s = self.decode_step(*self._heads(y), g, beta, states.index_select(0, slots))
        states.index_copy_(0, slots, s)
        return self._norm(core, z)

    def _norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Each head's output (rounded to the model dtype) normed, scaled and gated by z."""
        heads = (-1, self.v_heads, self.v_dim)
        return gated_rms_norm(core.to(z.dtype).view(heads), z.reshape(heads), self.norm_weight,
                              self.eps).flatten(1)

    def _heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, key = y.shape[0], self.k_heads * self.k_dim
        q, k, v = y.split([key, key, self.v_heads * self.v_dim], dim=-1)
        return (q.reshape(t, self.k_heads, self.k_dim), k.reshape(t, self.k_heads, self.k_dim),
                v.reshape(t, self.v_heads, self.v_dim))

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        return self.out_proj(attn)

    # ------------------------------------------------------------------ weights

    def _global_rows(self) -> dict[str, list[int]]:
        """Per stacked part: the indices, within that part over all heads, this rank holds."""
        r = self.tp.rank

        def heads(count: int, dim: int) -> list[int]:
            return list(range(r * count * dim, (r + 1) * count * dim))
        return {"q": heads(self.k_heads, self.k_dim), "k": heads(self.k_heads, self.k_dim),
                "v": heads(self.v_heads, self.v_dim), "z": heads(self.v_heads, self.v_dim),
                "b": heads(self.v_heads, 1), "a": heads(self.v_heads, 1)}

    def _row_of(self, part: str, i: int, interleaved: bool) -> int:
        """Row of part ``part``'s index ``i`` in its checkpoint tensor: in plain order (a
        q/k/v tensor holds q, k, v one after another), or ``interleaved`` (Qwen3-Next's
        in_proj_qkvz / in_proj_ba: one block per key head, [q, k, v, z] or [b, a] of the
        value heads that read it)."""
        s = self.spec
        key = s.num_k_heads * s.k_head_dim
        if not interleaved:
            return {"q": 0, "k": key, "v": 2 * key}.get(part, 0) + i
        per = s.num_v_heads // s.num_k_heads  # value heads per key head
        if part in ("b", "a"):
            group, within = divmod(i, per)
            return group * 2 * per + (per if part == "a" else 0) + within
        block = 2 * s.k_head_dim + 2 * per * s.v_head_dim
        if part in ("q", "k"):
            group, d = divmod(i, s.k_head_dim)
            return group * block + (s.k_head_dim if part == "k" else 0) + d
        head, d = divmod(i, s.v_head_dim)
        group, within = divmod(head, per)
        offset = 2 * s.k_head_dim + (per * s.v_head_dim if part == "z" else 0)
        return group * block + offset + within * s.v_head_dim + d

    def weight_targets(self, prefix: str) -> dict:
        """HF names under ``prefix`` (``model.layers.{i}.linear_attn.``) -> their places."""
        from ..models.weight_targets import WeightTarget, row_parallel_targets

        from ..models.qwen3_5_config import IN_PROJ_LAYOUTS, INTERLEAVED

        s, rows = self.spec, self._global_rows()
        hidden = self.in_proj.in_features
        key, value = s.num_k_heads * s.k_head_dim, s.num_v_heads * s.v_head_dim
        full_rows = {"q": key, "k": key, "v": value, "z": value, "b": s.num_v_heads,
                     "a": s.num_v_heads}
        t: dict[str, WeightTarget] = {}
        start = 0
        for name, parts in IN_PROJ_LAYOUTS[s.in_proj_layout]:
            full = sum(full_rows[p] for p in parts)
            index = [self._row_of(p, i, name in INTERLEAVED) for p in parts for i in rows[p]]
            t[f"{prefix}{name}.weight"] = _selected(self.in_proj.weight,
                                                     slice(start, start + len(index)), index,
                                                     (full, hidden))
            start += len(index)
        # the convolution's channels are q, k, v in plain head order in both families
        conv = [{"q": 0, "k": key, "v": 2 * key}[p] + i for p in "qkv" for i in rows[p]]
        t[f"{prefix}conv1d.weight"] = _selected(self.conv_weight, None, conv,
                                                 (s.conv_channels, 1, s.conv_kernel), squeeze=1)
        heads = even_shard(s.num_v_heads, self.tp)
        for name in ("A_log", "dt_bias"):
            t[f"{prefix}{name}"] = WeightTarget(getattr(self, name),
                                                shard=None if heads.whole else heads)
        t[f"{prefix}norm.weight"] = WeightTarget(self.norm_weight)
        row_parallel_targets(t, f"{prefix}out_proj.", self.out_proj)
        return t


def _selected(param: torch.Tensor, rows: Optional[slice], index: list[int],
              stored_shape: tuple[int, ...], squeeze: Optional[int] = None):
    """A target filled from the checkpoint rows ``index`` (in order), read whole."""
    from ..models.weight_targets import WeightTarget

    def pick(w: torch.Tensor) -> torch.Tensor:
        if squeeze is not None:
            w = w.squeeze(squeeze)
        if index == list(range(w.shape[0])):
            return w
        return w.index_select(0, torch.tensor(index, dtype=torch.long, device=w.device))
    return WeightTarget(param, rows, transform=pick, stored_shape=stored_shape)

"""Steps that verify speculative drafts, under CUDA graphs: one graph per batch rung, each
sequence given room for ``k + 1`` rows.

A verification step computes a decoding request's last token and its drafts at the positions
after it, and samples every row (docs/speculative.md). At batch 1 it is bound, like a decode
step, by the weights it reads; launched eagerly, an 8B model's step would spend more time
launching kernels than computing. So each rung b of the decode ladder is captured over
b × (k + 1) rows.

The rows run as decodes, each a position of its sequence with its own length: products of
up to eight rows take the gemv (``rows_as_alone``), which gives each row the bits it gets
alone (kernels/gemv.py), and the decode attention kernel splits each row's keys as for a
step of b sequences (``PagedSeqs.num_seqs``); so every row is computed exactly as its
decode step would have computed it, and greedy drafts the model would have decoded are
accepted.
The K/V of all rows are written before the attention reads them. A step packs each
sequence's rows (its last token and up to k drafts) in plan order; rows past the step's
belong to no sequence, write their K/V to the pad slot and are dropped. Full, sliding
and MLA attention run here (an MLA row absorbs its query and reads the latent cache as a
decode does: layers/mla.py).

A linear-attention layer (Qwen3.5) takes the rows in k + 1 rounds, round j the j-th row
of every sequence in the decode form, and after each round copies the states the plan
keeps (``StateMetadata.snapshots``: a rejected draft's state is rolled back to one). Which
row, state slot and snapshot slot each sequence has in each round are buffers
(``rounds``) written before a replay: a sequence with fewer rows, or none (padding),
points its rounds past its rows at the step's last row (then padding) and the spare slot.
Those rounds run whether a sequence has rows in them or not, so such a model also has
graphs of two rows a sequence (``VerifyGraphSet``): a probe of one draft, the step an
adapting drafter takes most when its drafts fail, replays two rounds, not k + 1.
"""

from __future__ import annotations

import array
from typing import Optional, Sequence

import torch

from .cuda_graphs import DecodeGraphs, ladder, write_inputs
from .kernel_policy import rows_as_alone
from .layers.attention import AttentionMetadata, PagedSeqs, ScheduledSeq
from .layers.linear_attention import PrefillRound, StateMetadata


class VerifyGraphs(DecodeGraphs):
    kind = "speculative verification"

    def __init__(self, model, kv_caches: list, block_size: int, max_model_len: int,
                 pad_blocks: Sequence[int], device: torch.device, max_batch: int,
                 query_rows: int, state_groups: Sequence[bool] = ()):
        """``query_rows``: the most rows of a sequence, k + 1."""
        self.query_rows = query_rows
        # per state group: [3, rounds, sequences] of (row, state slot, snapshot slot)
        width = ladder(max_batch)[-1]
        states = list(state_groups) or [False] * len(pad_blocks)
        self.rounds = [torch.full((3, query_rows, width), pad, dtype=torch.long, device=device)
                       if state else None for state, pad in zip(states, pad_blocks)]
        for rounds in self.rounds:
            if rounds is not None:
                rounds[0].zero_()  # (the capture's rows: any row, the spare slot)
        super().__init__(model, kv_caches, block_size, max_model_len, pad_blocks, device,
                         max_batch, state_groups)

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = b * self.query_rows
        metas = [self._state_metadata(rounds[:, :, :b]) if rounds is not None else
                 AttentionMetadata(slots[:t], [], t, False, self.block_size, decode=PagedSeqs(
                     tables[:t], self.seq_lens[:t], self.q_start[:t], self.q_lens[:t],
                     self.max_model_len, 1, num_seqs=b))
                 for slots, tables, rounds in zip(self.slots, self.tables, self.rounds)]
        with rows_as_alone():  # each row's products as its decode step's
            hidden = self.model(self.input_ids[:t], self.positions[:t], self.max_model_len - 1,
                                metas, self.kv_caches)
            return hidden, self.model.compute_logits(hidden)

    def _state_metadata(self, rounds: torch.Tensor) -> StateMetadata:
        rows, slots, snapshots = rounds
        return StateMetadata(None, None, tuple(
            PrefillRound.one_row_each(rows[j], slots[j]) for j in range(self.query_rows)),
            tuple((j, slots[j], snapshots[j]) for j in range(self.query_rows)), padded=True)

    def fits(self, seqs: Sequence[ScheduledSeq]) -> int:
        """The rung a step of these sequences replays (0: none fits)."""
        if any(s.num_tokens > self.query_rows for s in seqs):
            return 0
        return self.rung(len(seqs))

    def run(self, seqs: Sequence[Sequence[ScheduledSeq]], input_ids: list[int],
            positions: list[int], rung: int,
            pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
            snapshots: Sequence[Sequence[tuple[int, int]]] = ()
            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(hidden states [T, hidden], logits [T, vocab]: None on TP ranks but 0) of a step
        whose every row samples (``DecodeGraphs.run``); ``snapshots``: each state group's
        (row, snapshot slot)."""
        t, bs = len(positions), self.block_size
        width = max(-(-(s.start + s.num_tokens) // bs) for s in seqs[0])
        flat = array.array("i")
        for s in seqs[0]:  # each row's length once its position is written
            flat.extend(range(s.start + 1, s.start + s.num_tokens + 1))
        for g, (group, pad) in enumerate(zip(seqs, self.pad_blocks)):
            # per group: slots, then row tables (a state group's: unread, the layout's)
            if self.rounds[g] is not None:
                self._write_rounds(g, group, snapshots[g] if snapshots else (), rung)
                flat.extend([pad] * (t + t * width))
                continue
            for s in group:
                flat.extend(s.block_ids[p // bs] * bs + p % bs
                            for p in range(s.start, s.start + s.num_tokens))
            for s in group:
                table = list(s.block_ids[:width])
                table += [pad] * (width - len(table))
                for _ in range(s.num_tokens):
                    flat.extend(table)
        host = torch.frombuffer(flat, dtype=torch.int32)
        self.seq_lens[:t].copy_(host[:t], non_blocking=True)
        self._copy_groups(host, t, t, t, width)
        write_inputs(self.input_ids, self.positions, input_ids, positions, pending)
        self._pad_rows(t, rung * self.query_rows)
        return self._replay(rung, t)

    def _write_rounds(self, g: int, seqs: Sequence[ScheduledSeq],
                      snapshots: Sequence[tuple[int, int]], rung: int) -> None:
        """State group ``g``'s rounds for a replay at ``rung``: each sequence's j-th row and
        slot, and where its state after that row is kept (the spare slot: nowhere)."""
        rows, spare = self.query_rows, self.pad_blocks[g]
        last = rung * rows - 1  # padding whenever a sequence has fewer rows than k + 1
        keep = dict(snapshots)
        table = array.array("q", [last] * (rows * rung) + [spare] * (2 * rows * rung))
        for i, s in enumerate(seqs):
            for j in range(s.num_tokens):
                at = j * rung + i
                table[at] = s.row + j
                table[rows * rung + at] = s.block_ids[0]
                table[2 * rows * rung + at] = keep.get(s.row + j, spare)
        host = torch.frombuffer(table, dtype=torch.long).view(3, rows, rung)
        self.rounds[g][:, :, :rung].copy_(host, non_blocking=True)


class VerifyGraphSet:
    """The verify graphs of each row count a sequence may take, fewest rows first; a step
    replays the first whose rows hold its longest sequence's."""

    def __init__(self, graphs: Sequence[VerifyGraphs]):
        self.graphs = sorted(graphs, key=lambda g: g.query_rows)

    @property
    def max_rows(self) -> int:
        """The most rows a replay computes (its largest rung's)."""
        g = self.graphs[-1]
        return g.batch_sizes[-1] * g.query_rows if g.batch_sizes else 0

    def fits(self, seqs: Sequence[ScheduledSeq]) -> tuple[Optional[VerifyGraphs], int]:
        """(the graphs, the rung) a step of these sequences replays ((None, 0): none)."""
        rows = max(s.num_tokens for s in seqs)
        for graphs in self.graphs:
            if graphs.query_rows >= rows:
                rung = graphs.fits(seqs)
                return (graphs, rung) if rung else (None, 0)
        return None, 0

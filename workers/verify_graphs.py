"""Steps that verify speculative drafts, under CUDA graphs: one graph per batch rung, each
sequence given room for ``k + 1`` rows.

A verification step computes a decoding request's last token and its drafts at the positions
after it, and samples every row (docs/speculative.md). At batch 1 it is bound, like a decode
step, by the weights it reads; launched eagerly, an 8B model's step would spend more time
launching kernels than computing. So each rung b of the decode ladder is captured over
b × (k + 1) rows. A step packs each sequence's rows (its last token and up to k drafts) in
plan order; the prefill attention kernel reads each sequence's first row, row count and
length from device buffers, so one graph serves any mix of draft counts. Rows past the
step's write their K/V to the pad slot, belong to no sequence and are dropped; sequences past
the step's have no rows. Only the Triton attention of full and sliding layers runs here (a
linear-attention model does not speculate; MLA verifies eagerly).
"""

from __future__ import annotations

import array
import itertools
from typing import Optional, Sequence

import torch

from .cuda_graphs import DecodeGraphs, write_inputs
from .layers.attention import AttentionMetadata, PagedSeqs, ScheduledSeq


class VerifyGraphs(DecodeGraphs):
    kind = "speculative verification"

    def __init__(self, model, kv_caches: list, block_size: int, max_model_len: int,
                 pad_blocks: Sequence[int], device: torch.device, max_batch: int,
                 query_rows: int):
        """``query_rows``: the most rows of a sequence, k + 1."""
        self.query_rows = query_rows
        super().__init__(model, kv_caches, block_size, max_model_len, pad_blocks, device,
                         max_batch)

    def _forward(self, b: int) -> torch.Tensor:
        t = b * self.query_rows
        metas = [AttentionMetadata(slots[:t], [], t, False, self.block_size, prefill=PagedSeqs(
                     tables[:b], self.seq_lens[:b], self.q_start[:b], self.q_lens[:b],
                     self.max_model_len, self.query_rows))
                 for slots, tables in zip(self.slots, self.tables)]
        hidden = self.model(self.input_ids[:t], self.positions[:t], self.max_model_len - 1,
                            metas, self.kv_caches)
        return self.model.compute_logits(hidden)

    def _reset_padding(self, start: int, stop: int, first_row: Optional[int] = None) -> None:
        """Sequences [start, stop) get no rows; rows from ``first_row`` (default: the first of
        sequence ``start``) to the rung's end write the pad slot."""
        rows = slice(start * self.query_rows if first_row is None else first_row,
                     stop * self.query_rows)
        for slots, tables, pad in zip(self.slots, self.tables, self.pad_blocks):
            slots[rows].fill_(pad * self.block_size)
            tables[start:stop, 0].fill_(pad)
        self.q_lens[start:stop].zero_()
        self.seq_lens[start:stop].fill_(1)
        self.input_ids[rows].zero_()
        self.positions[rows].zero_()

    def fits(self, seqs: Sequence[ScheduledSeq]) -> int:
        """The rung a step of these sequences replays (0: none fits)."""
        if any(s.num_tokens > self.query_rows for s in seqs):
            return 0
        return self.rung(len(seqs))

    def run(self, seqs: Sequence[Sequence[ScheduledSeq]], input_ids: list[int],
            positions: list[int], rung: int,
            pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """Logits [T, vocab] of a step whose every row samples (None on TP ranks but 0)."""
        n, t, bs = len(seqs[0]), len(positions), self.block_size
        lens = [s.num_tokens for s in seqs[0]]
        ends = [s.start + s.num_tokens for s in seqs[0]]
        width = max(-(-e // bs) for e in ends)
        flat = array.array("i")
        flat.extend(ends)  # seq_lens once the rows are written
        flat.extend(itertools.accumulate([0] + lens[:-1]))  # each sequence's first row
        flat.extend(lens)
        for group, pad in zip(seqs, self.pad_blocks):  # per group: slots, then tables
            for s in group:
                flat.extend(s.block_ids[p // bs] * bs + p % bs
                            for p in range(s.start, s.start + s.num_tokens))
            for s in group:
                table = s.block_ids[:width]
                flat.extend(table)
                flat.extend([pad] * (width - len(table)))
        host = torch.frombuffer(flat, dtype=torch.int32)
        for i, buffer in enumerate((self.seq_lens, self.q_start, self.q_lens)):
            buffer[:n].copy_(host[i * n:(i + 1) * n], non_blocking=True)
        self._copy_groups(host, 3 * n, n, t, width)
        write_inputs(self.input_ids, self.positions, input_ids, positions, pending)
        self._reset_padding(n, rung, first_row=t)
        graph, logits = self.graphs[rung]
        graph.replay()
        return None if logits is None else logits[:t]

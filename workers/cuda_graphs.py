"""Decode steps under CUDA graphs: one graph per rung of a batch-size ladder.

A decode step launches hundreds of small kernels; at batch 1 their launch cost
is larger than the GPU's work. Each rung's forward (embedding, every layer,
final norm, LM head) is captured once at startup over static input buffers;
a step of B decodes fills the buffers, pads to the nearest rung and replays.

Padding rows attend to one position of the spare zeroed block past the end of
each KV cache group's pool (``PagedKVCache.pad_blocks``) and write their K/V there,
so they read finite values and touch no real sequence. Rows never mix, so a padded
row's output is simply dropped.

Each cache group (full attention, a sliding window: ``kv_cache.py``) has its own static
block table and slot buffers, and each layer's attention reads its own group's. A state
group (linear attention) has a static buffer of state slots instead; padding rows update
the spare slot past the pool's end.

The attention kernels size their launch grid from the longest sequence; the
graphs are captured at ``max_model_len`` and a replay skips the splits past
each sequence's end.
"""

from __future__ import annotations

import array
import logging
import time
from typing import Callable, Optional, Sequence

import torch

from .layers.attention import AttentionMetadata, PagedSeqs, ScheduledSeq
from .layers.linear_attention import StateMetadata

logger = logging.getLogger("pocketllm.worker")

CAPTURE_BUDGET_S = 120.0  # startup stops adding rungs past this (smaller batches come first)


def ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 after."""
    rungs = [1, 2, 4, 8]
    b = 8
    while b < max_batch:
        b += 8 if b < 64 else 16 if b < 256 else 32
        rungs.append(b)
    return sorted({min(r, max_batch) for r in rungs})


def write_inputs(ids_buf: torch.Tensor, positions_buf: torch.Tensor, input_ids: list[int],
                 positions: list[int], pending: Optional[tuple[torch.Tensor, torch.Tensor]]
                 ) -> None:
    """A step's token ids and positions into a graph's static buffers, without waiting for
    the GPU (``device.to_device``); ``pending``: (rows, tokens) already on the device,
    written over those input rows."""
    n = len(input_ids)
    ids_buf[:n].copy_(torch.tensor(input_ids, dtype=torch.long), non_blocking=True)
    if pending is not None:
        ids_buf[pending[0]] = pending[1]
    positions_buf[:n].copy_(torch.tensor(positions, dtype=torch.long), non_blocking=True)


def smallest_rung(rungs: Sequence[int], n: int) -> int:
    """The smallest of the ascending ``rungs`` that holds ``n`` (0: none fits)."""
    return next((r for r in rungs if r >= n), 0)


def capture_cuda_graph(fn: Callable[[], None], pool) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    graph.replay()  # a graph's first replay uploads it: now, not in the first request
    return graph


def capture_ladder(rungs: Sequence[int], capture: Callable, started: float, budget_s: float,
                   stopped_warning: str) -> dict:
    """``capture(rung, pool) -> (captured, pool)`` for each rung, largest first, so the
    smaller ones reuse its memory pool. Past ``budget_s`` since ``started`` the smaller
    rungs are skipped: their steps pad up to the smallest captured one (slower, exact)."""
    captured, pool = {}, None
    for r in sorted(rungs, reverse=True):
        if time.perf_counter() - started > budget_s:
            logger.warning(stopped_warning, budget_s, r + 1)
            break
        captured[r], pool = capture(r, pool)
    return captured


class DecodeGraphs:
    query_rows = 1  # rows of a sequence (verify_graphs.VerifyGraphs: its drafts' too)
    kind = "decode"

    def __init__(self, model, kv_caches: list, block_size: int, max_model_len: int,
                 pad_blocks: Sequence[int], device: torch.device, max_batch: int,
                 state_groups: Sequence[bool] = ()):
        """``pad_blocks``: each cache group's spare block (the groups' order); a state
        group's (``state_groups[g]``) is its spare slot."""
        self.model, self.kv_caches = model, kv_caches
        self.state_groups = list(state_groups) or [False] * len(pad_blocks)
        self.block_size, self.max_model_len, self.device = block_size, max_model_len, device
        self.pad_blocks = list(pad_blocks)
        self.width = -(-max_model_len // block_size)
        rungs = ladder(max_batch)
        g = rungs[-1]
        t = g * self.query_rows
        self.input_ids = torch.zeros(t, dtype=torch.long, device=device)
        self.positions = torch.zeros(t, dtype=torch.long, device=device)
        # per row (a decode: one a sequence): its length, its place, one query
        self.seq_lens = torch.ones(t, dtype=torch.int32, device=device)
        self.q_start = torch.arange(t, dtype=torch.int32, device=device)
        self.q_lens = torch.ones(t, dtype=torch.int32, device=device)
        # per cache group: the new tokens' slots and each row's block table
        # (a state group's: its rows' state slots, int64 for index_select / index_copy_)
        self.slots = [torch.zeros(t, dtype=torch.long if state else torch.int32, device=device)
                      for state in self.state_groups]
        self.tables = [torch.full((t, self.width), pad, dtype=torch.int32, device=device)
                       for pad in self.pad_blocks]
        # rung -> (graph, its hidden-state and logits buffers, overwritten by each replay)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._capture(rungs)

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self.graphs)

    def _metas(self, b: int) -> list:
        """Each cache group's metadata of a step of ``b`` one-row sequences, over the
        static buffers."""
        return [StateMetadata(slice(0, b), slots[:b], ()) if state else
                AttentionMetadata(slots[:b], [], b, False, self.block_size, decode=PagedSeqs(
                    tables[:b], self.seq_lens[:b], self.q_start[:b], self.q_lens[:b],
                    self.max_model_len, 1))
                for slots, tables, state in zip(self.slots, self.tables, self.state_groups)]

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states before the final norm, logits) of a step of ``b`` sequences."""
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.max_model_len - 1,
                            self._metas(b), self.kv_caches)
        return hidden, self.model.compute_logits(hidden)

    def _capture(self, rungs: Sequence[int]) -> None:
        self._reset_padding(0, rungs[-1])  # every row is padding while capturing
        started = time.perf_counter()
        # Compile every kernel before any capture (a compile may synchronize); one-row
        # steps, and a verification's rows at batch 1, take their own (gemv) kernels. Also
        # grows the rotary tables.
        for b in {rungs[0], rungs[-1]}:
            self._forward(b)
        torch.cuda.synchronize(self.device)

        def capture(b: int, pool):
            out = []
            graph = capture_cuda_graph(lambda: out.append(self._forward(b)), pool)
            return (graph, *out[0]), graph.pool()

        self.graphs.update(capture_ladder(
            rungs, capture, started, CAPTURE_BUDGET_S,
            "CUDA graph capture stopped after %.0fs: batches under %d pad up to the next "
            "captured size"))
        torch.cuda.synchronize(self.device)
        logger.info("captured %d %s CUDA graphs (batch %d..%d) in %.1fs", len(self.graphs),
                    self.kind, min(self.graphs, default=0), max(self.graphs, default=0),
                    time.perf_counter() - started)

    def _reset_padding(self, start: int, stop: int) -> None:
        """Sequences [start, stop) become padding: their rows."""
        self._pad_rows(start * self.query_rows, stop * self.query_rows)

    def _pad_rows(self, first: int, stop: int) -> None:
        rows = slice(first, stop)
        for slots, tables, pad, state in zip(self.slots, self.tables, self.pad_blocks,
                                             self.state_groups):
            slots[rows].fill_(pad if state else pad * self.block_size)
            tables[rows, 0].fill_(pad)
        self.seq_lens[rows].fill_(1)
        self.input_ids[rows].zero_()
        self.positions[rows].zero_()

    def _copy_groups(self, host: torch.Tensor, at: int, n: int, rows: int, width: int) -> None:
        """Each group's ``rows`` slots, then its [n, width] tables, from ``host[at:]``."""
        for slots, tables in zip(self.slots, self.tables):
            slots[:rows].copy_(host[at:at + rows], non_blocking=True)
            tables[:n, :width].copy_(host[at + rows:at + rows + n * width].view(n, width),
                                     non_blocking=True)
            at += rows + n * width

    def rung(self, batch: int) -> int:
        """The captured batch size a step of ``batch`` decodes replays (0: none fits)."""
        return smallest_rung(self.batch_sizes, batch)

    def run(self, seqs: Sequence[Sequence[ScheduledSeq]], input_ids: list[int],
            positions: list[int], rung: int,
            pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None
            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(hidden states [B, hidden] before the final norm, logits [B, vocab]: None on TP
        ranks but 0) of one all-decode step of B sequences, in the graph's buffers (the next
        replay overwrites them). ``seqs``: per cache group, the B sequences with that
        group's block tables.
        ``pending``: (rows, tokens) already on the device, written over those input rows."""
        n = len(positions)
        bs = self.block_size
        width = max(-(-(p + 1) // bs) for p in positions)
        flat = array.array("i")
        flat.extend(p + 1 for p in positions)  # seq_lens once the token is written
        for group, pad, state in zip(seqs, self.pad_blocks, self.state_groups):
            # per group: slots, then tables (a state group: each sequence's state slot)
            if state:
                flat.extend(s.block_ids[0] for s in group)
                flat.extend([pad] * (len(group) * width))  # unread: keeps the layout
                continue
            for s, p in zip(group, positions):  # slot of the one new token per sequence
                flat.append(s.block_ids[p // bs] * bs + p % bs)
            for s in group:
                table = s.block_ids[:width]
                flat.extend(table)
                if len(table) < width:
                    flat.extend([pad] * (width - len(table)))
        host = torch.frombuffer(flat, dtype=torch.int32)
        # non_blocking: a blocking copy would wait for the step still running (device.to_device)
        self.seq_lens[:n].copy_(host[:n], non_blocking=True)
        self._copy_groups(host, n, n, n, width)
        write_inputs(self.input_ids, self.positions, input_ids, positions, pending)
        if n < rung:
            self._reset_padding(n, rung)
        return self._replay(rung, n)

    def _replay(self, rung: int, rows: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        graph, hidden, logits = self.graphs[rung]
        graph.replay()
        return hidden[:rows], None if logits is None else logits[:rows]

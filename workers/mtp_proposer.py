"""The drafter of ``speculative_method="mtp"``: the checkpoint's multi-token-prediction
layer (``models/mtp_layer.py``), fed the target's own hidden states (its pool and its
sampling: ``proposer.py``).

The layer at position t reads the target's hidden state at t and token t + 1, so its
KV cache can only be written once both are known: after a step, for the rows whose next
token is known (a prompt chunk's, the verified ones of a decode or a verification; a
rejected draft's row is written again once the target has computed it for the right
token). The step's hidden states come from the forward (``LaunchedStep.hidden``), a CUDA
graph's included.

That pass waits until the layer is needed: a request's verified rows are kept (their
hidden states, about 8 KB a row for a 4096-wide model) until a step asks it for
proposals, or until it holds ``WAIT_ROWS`` of them; then every request of the step with
rows waiting passes them through the layer at once, as a prompt chunk would. A request
whose drafts keep failing proposes only after each pause (``scheduler/drafter.py``), so
at zero acceptance the layer runs about once a pause over the whole pause's rows, not
eagerly after every step; when every step proposes, nothing waits.

A request asked to propose then takes its last row's guess as the first draft, and the
layer guesses on from its own output and that draft, one position further each time
(its KV there is rewritten when the target computes those positions). Each guess's token
feeds the next on the device, and on a GPU each guess after the first replays a CUDA graph
(``GuessGraphs``): the host waits once for a proposal's drafts, not once a guess.

A prompt served from the prefix cache is not computed, so its layer KV is the one the
request that computed those blocks wrote; at a block's last position that request's
next token may differ from this one's, which only makes a draft less likely accepted.
"""

from __future__ import annotations

from typing import Optional

import torch

from pocketllm.config import EngineArgs
from pocketllm.proto.messages import StepResult

from .cuda_graphs import DecodeGraphs, ladder
from .proposer import Proposer, verified_tokens
from .step_rows import ScheduledSeq

# The most rows a request keeps waiting for the layer: bounds the kept hidden states (at
# most this many rows a running request) and how rarely a request that never proposes
# (paused, or in a batch too big to draft) has its layer KV written.
WAIT_ROWS = 32


class Waiting:
    """A request's verified rows not yet through the layer, from position ``start``."""

    def __init__(self, start: int):
        self.start = start
        self.hidden: list[torch.Tensor] = []  # [rows, hidden] pieces, in position order
        self.ids: list[int] = []  # each row's next token

    @property
    def end(self) -> int:
        return self.start + len(self.ids)


class MTPProposer(Proposer):
    reads_hidden = True

    def __init__(self, runner, args: EngineArgs):
        target = runner.model
        self.mtp = target.mtp  # built with the target (``ModelRunner.build``)
        super().__init__(runner, args, runner.backend, 1, target.num_local_kv_heads,
                         target.cfg.head_dim, target.latent_cache_width)
        self.final_norm = target.norm  # the layer reads the target's normed hidden states
        self.waiting: dict[str, Waiting] = {}
        self.k, self.hidden_size = args.num_speculative_tokens, target.cfg.hidden_size
        self.graphs: Optional[GuessGraphs] = None  # (``capture``)

    def forget(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)

    def after_step(self, result: Optional[StepResult], step, requests: dict
                   ) -> Optional[list[list[int]]]:
        if step.hidden is None:
            return None
        tokens_of = verified_tokens(result, step.slots, requests) if result is not None else {}
        asked = {rid: count for rid, count in (step.proposals or {}).items()
                 if count > 0 and result is not None}
        ready = []  # (request, its sequence this step, verified rows, their next tokens, last?)
        for rid, seq in zip(step.seq_ids, step.seqs):
            state = requests.get(rid)
            tokens = tokens_of.get(rid, state.token_ids if state is not None else None)
            n = 0 if tokens is None else min(seq.num_tokens, len(tokens) - 1 - seq.start)
            if n <= 0:
                continue
            waiting = self.waiting.get(rid)
            if waiting is not None and waiting.end != seq.start:  # not a continuation: drop
                del self.waiting[rid]
            ready.append((rid, seq, n, tokens[seq.start + 1:seq.start + n + 1],
                          seq.start + n == len(tokens) - 1))
        if not ready:
            return None
        if not any(rid in asked or self._waiting_rows(rid) + n >= WAIT_ROWS
                   for rid, _seq, n, _ids, _last in ready):
            self._wait(step.hidden, ready)
            return None
        out, last = self._pass(step.hidden, ready)
        if not asked:
            return None
        rows = [(rid, last[rid][0], count) for rid, count in asked.items() if rid in last]
        proposed = self._propose(out, rows, [last[rid][1] for rid, _, _ in rows], requests)
        return [proposed.get(rid, []) for rid in result.request_ids]

    def _waiting_rows(self, request_id: str) -> int:
        waiting = self.waiting.get(request_id)
        return 0 if waiting is None else len(waiting.ids)

    def _wait(self, hidden: torch.Tensor, ready: list) -> None:
        """Keep the step's verified rows for a later pass (a copy: the step's states are
        a graph's buffer, or hold rows nobody waits for)."""
        rows = [r for _rid, seq, n, _ids, _last in ready for r in range(seq.row, seq.row + n)]
        kept = (hidden if rows == list(range(hidden.shape[0])) and hidden._base is None
                else hidden.index_select(0, self.ids(rows)))
        at = 0
        for rid, seq, n, ids, _last in ready:
            waiting = self.waiting.setdefault(rid, Waiting(seq.start))
            waiting.hidden.append(kept[at:at + n])
            waiting.ids.extend(ids)
            at += n

    def _pass(self, hidden: torch.Tensor, ready: list
              ) -> tuple[torch.Tensor, dict[str, tuple[int, int]]]:
        """The layer over every ready request's waiting rows and this step's: its output
        rows, and per request whose tokens end with this step's, the (row, position) of
        its last verified position (its guess follows the tokens)."""
        pieces, seqs, ids, positions = [], [], [], []
        last: dict[str, tuple[int, int]] = {}
        for rid, seq, n, step_ids, is_last in ready:
            waiting = self.waiting.pop(rid, None) or Waiting(seq.start)
            pieces += [*waiting.hidden, hidden[seq.row:seq.row + n]]
            count = len(waiting.ids) + n
            seqs.append(ScheduledSeq(seq.block_ids, waiting.start, count, len(ids)))
            ids += waiting.ids + step_ids
            positions.extend(range(waiting.start, waiting.start + count))
            if is_last:
                last[rid] = (len(ids) - 1, positions[-1])
        states = self.final_norm(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
        out = self.mtp(self.ids(ids), self.ids(positions), max(positions), states,
                       self.metadata(seqs), self.kv.layer_caches[0])
        return out, last

    def _propose(self, out: torch.Tensor, asked: list[tuple[str, int, int]],
                 positions: list[int], requests: dict) -> dict[str, list[int]]:
        """``asked``: (request, its row of ``out``, how many drafts); ``positions``: each
        row's position t (its guess is token t + 2). Each guess feeds the next on the
        device; the host waits once, for all of them."""
        drafts: dict[str, list[int]] = {rid: [] for rid, _, _ in asked}
        tables = [requests[rid].block_ids[0] for rid, _, _ in asked]
        # a guess's successor writes the layer's KV at t + 1: within the request's blocks
        counts = [min(count, len(table) * self.block_size - t)
                  for (_, _, count), table, t in zip(asked, tables, positions)]
        live = [i for i, count in enumerate(counts) if count > 0]
        if not live:
            return drafts
        h = out.index_select(0, self.ids([asked[i][1] for i in live]))
        logits = self.mtp.logits(h)
        guessed = []  # per round: (its requests, their tokens on the device)
        while True:
            tokens = self.draw_on_device(logits, [requests[asked[i][0]].sampling for i in live],
                                         [positions[i] + 2 for i in live])
            guessed.append((live, tokens))
            more = [j for j, i in enumerate(live) if counts[i] > len(guessed)]
            if not more:
                break
            if len(more) < len(live):
                pick = self.ids(more)
                tokens, h = tokens.index_select(0, pick), h.index_select(0, pick)
            live = [live[j] for j in more]
            for i in live:
                positions[i] += 1
            seqs = [ScheduledSeq(tables[i], positions[i], 1, j) for j, i in enumerate(live)]
            h, logits = self._guess(seqs, tokens, [positions[i] for i in live], h)
        host = iter(torch.cat([tokens for _, tokens in guessed]).tolist())
        for round_live, _ in guessed:
            for i in round_live:
                drafts[asked[i][0]].append(next(host))
        return drafts

    def _guess(self, seqs: list[ScheduledSeq], tokens: torch.Tensor, positions: list[int],
               hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's next guess for one row a sequence (a CUDA graph's where captured):
        (its output, the logits of the token after)."""
        rung = self.graphs.rung(len(seqs)) if self.graphs is not None else 0
        if rung:
            return self.graphs.guess(seqs, tokens, positions, hidden, rung)
        h = self.mtp(tokens, self.ids(positions), max(positions), hidden, self.metadata(seqs),
                     self.kv.layer_caches[0])
        return h, self.mtp.logits(h)

    def capture(self, max_batch: int, max_model_len: int) -> None:
        """CUDA graphs for the guesses after a proposal's first (none when k = 1)."""
        if self.k > 1:
            self.graphs = GuessGraphs(self.mtp, self.kv.layer_caches, self.block_size,
                                      max_model_len, self.kv.pad_blocks, self.device,
                                      max_batch, self.hidden_size, self.dtype)


class GuessGraphs(DecodeGraphs):
    """The MTP layer's one-row guesses under CUDA graphs, one per batch rung: the layer's
    input hidden states and its token are static buffers too (written on the device, from
    the last guess), and each graph ends with the target's LM head."""

    kind = "MTP guess"

    def __init__(self, mtp, layer_caches: list, block_size: int, max_model_len: int,
                 pad_blocks: list[int], device: torch.device, max_batch: int,
                 hidden_size: int, dtype: torch.dtype):
        width = ladder(max_batch)[-1]
        self.hidden_in = torch.zeros(width, hidden_size, dtype=dtype, device=device)
        self.rows = torch.arange(width, device=device)
        super().__init__(mtp, layer_caches, block_size, max_model_len, pad_blocks, device,
                         max_batch)

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(self.input_ids[:b], self.positions[:b], self.max_model_len - 1,
                         self.hidden_in[:b], self._metas(b)[0], self.kv_caches[0])
        return out, self.model.logits(out)

    def guess(self, seqs: list[ScheduledSeq], tokens: torch.Tensor, positions: list[int],
              hidden: torch.Tensor, rung: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's outputs, the logits) of ``seqs``, each fed its token on the device
        and its hidden state, in the graph's buffers (the next replay overwrites them)."""
        n = len(positions)
        self.hidden_in[:n].copy_(hidden)
        return self.run([seqs], [0] * n, positions, rung, (self.rows[:n], tokens))

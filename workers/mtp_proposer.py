"""The drafter of ``speculative_method="mtp"``: the checkpoint's multi-token-prediction
layer (``models/mtp_layer.py``), fed the target's own hidden states (its pool and its
sampling: ``proposer.py``).

The layer at position t reads the target's hidden state at t and token t + 1, so its
KV cache can only be written once both are known: after every step, for every request
in it, the rows whose next token is known (a prompt chunk's, the verified ones of a
decode or a verification; a rejected draft's row is written again once the target has
computed it for the right token). The step's hidden states come from the forward
(``LaunchedStep.hidden``), a CUDA graph's included.

A request asked to propose then takes its last row's guess as the first draft, and the
layer guesses on from its own output and that draft, one position further each time
(its KV there is rewritten when the target computes those positions).

A prompt served from the prefix cache is not computed, so its layer KV is the one the
request that computed those blocks wrote; at a block's last position that request's
next token may differ from this one's, which only makes a draft less likely accepted.
"""

from __future__ import annotations

from typing import Optional

import torch

from pocketllm.config import EngineArgs
from pocketllm.proto.messages import StepResult

from .proposer import Proposer, verified_tokens
from .step_rows import ScheduledSeq


class MTPProposer(Proposer):
    reads_hidden = True

    def __init__(self, runner, args: EngineArgs):
        target = runner.model
        self.mtp = target.mtp  # built with the target (``ModelRunner.build``)
        super().__init__(runner, args, runner.backend, 1, target.num_local_kv_heads,
                         target.cfg.head_dim, target.latent_cache_width)
        self.final_norm = target.norm  # the layer reads the target's normed hidden states

    def after_step(self, result: Optional[StepResult], step, requests: dict
                   ) -> Optional[list[list[int]]]:
        if step.hidden is None:
            return None
        tokens_of = verified_tokens(result, step.slots, requests) if result is not None else {}
        seqs, rows, ids, positions = [], [], [], []
        last: dict[str, int] = {}  # request -> the row of its last verified position
        for rid, seq in zip(step.seq_ids, step.seqs):
            state = requests.get(rid)
            tokens = tokens_of.get(rid, state.token_ids if state is not None else None)
            n = 0 if tokens is None else min(seq.num_tokens, len(tokens) - 1 - seq.start)
            if n <= 0:
                continue
            seqs.append(ScheduledSeq(seq.block_ids, seq.start, n, len(ids)))
            rows.extend(range(seq.row, seq.row + n))
            ids.extend(tokens[seq.start + 1:seq.start + n + 1])
            positions.extend(range(seq.start, seq.start + n))
            if seq.start + n == len(tokens) - 1:
                last[rid] = len(ids) - 1
        if not seqs:
            return None
        hidden = self.final_norm(step.hidden.index_select(0, self.ids(rows)))
        out = self.mtp(self.ids(ids), self.ids(positions), max(positions), hidden,
                       self.metadata(seqs), self.kv.layer_caches[0])
        if result is None or not step.proposals:
            return None
        asked = [(rid, last[rid], count) for rid, count in step.proposals.items()
                 if count > 0 and rid in last]
        proposed = self._propose(out, asked, [positions[row] for _, row, _ in asked], requests)
        return [proposed.get(rid, []) for rid in result.request_ids]

    def _propose(self, out: torch.Tensor, asked: list[tuple[str, int, int]],
                 positions: list[int], requests: dict) -> dict[str, list[int]]:
        """``asked``: (request, its row of ``out``, how many drafts); ``positions``: each
        row's position t (its guess is token t + 2)."""
        drafts: dict[str, list[int]] = {rid: [] for rid, _, _ in asked}
        tables = [requests[rid].block_ids[0] for rid, _, _ in asked]
        # a guess's successor writes the layer's KV at t + 1: within the request's blocks
        counts = [min(count, len(table) * self.block_size - t)
                  for (_, _, count), table, t in zip(asked, tables, positions)]
        live = [i for i, count in enumerate(counts) if count > 0]
        h = out.index_select(0, self.ids([asked[i][1] for i in live])) if live else None
        while live:
            tokens = self.draw(self.mtp.logits(h), [requests[asked[i][0]].sampling for i in live],
                               [positions[i] + 2 for i in live])
            for i, token in zip(live, tokens):
                drafts[asked[i][0]].append(token)
            more = [j for j, i in enumerate(live) if len(drafts[asked[i][0]]) < counts[i]]
            if not more:
                break
            live = [live[j] for j in more]
            for i in live:
                positions[i] += 1
            seqs = [ScheduledSeq(tables[i], positions[i], 1, j) for j, i in enumerate(live)]
            h = self.mtp(self.ids([tokens[j] for j in more]), self.ids([positions[i] for i in live]),
                         max(positions[i] for i in live), h.index_select(0, self.ids(more)),
                         self.metadata(seqs), self.kv.layer_caches[0])
        return drafts

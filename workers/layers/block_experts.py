"""A layer's routed experts kept as the checkpoint stored them: GGUF blocks on the CPU.

A quantized MoE file is mostly experts (Qwen3-30B-A3B: 29 of its 30 B parameters), so
expanding them to float would need several times the file's size in memory. Here each
expert's [gate | up] and down matrices are a ``BlockWeight`` of their own, views of
the mapped file, multiplied by the same integer kernels as a dense layer's
(``kernels/cpu_quant``): a one-token step reads only the k experts it was routed to,
in their block type.

The computation is ``torch_experts``' (``layers/moe.py``), in float32 (the CPU path's
dtype): each (token, expert) pair's [gate | up] product, the activation and the down
product, scaled by its routing weight and summed per token in a fixed order. The rows go
to the library in runs, each bound to its expert's parts, as many runs a call as it
takes (``cpu_quant.linear_rows``): a few pairs (decode) a run each, more sorted by
expert into a run per expert hit; a run of at least ``gemm_rows()`` rows (a long
prompt's) takes its own call, whose many-row product decodes the expert's weights once. A decode step whose layers all bind runs this in C
instead (``kernels/cpu_layer.py``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .activation import GatedAct, gated
from .block_weight import BlockWeight

# Steps of at most this many (token, expert) pairs multiply each pair as a run of its own
# (decode: no sort); larger ones sort the pairs by expert, so that each expert's weights
# are read once for all its rows.
PAIRS_MAX = 32


class BlockExperts(nn.Module):
    """``num_experts`` experts of ``hidden`` -> ``local`` (this rank's intermediate
    columns) -> ``hidden``; ``stored``: the block types of gate, up and down."""

    def __init__(self, num_experts: int, hidden: int, local: int,
                 stored: Sequence[Optional[int]]):
        super().__init__()
        gate, up, down = stored
        self.gate_up = nn.ModuleList(
            BlockWeight(hidden, [local, local], [gate, up])
            for _ in range(num_experts))
        self.down = nn.ModuleList(
            BlockWeight(local, [hidden], [down]) for _ in range(num_experts))
        self.hidden = hidden
        # Runs batched into library calls need every part in a block type (a float part
        # takes torch's product, outside the library's).
        self.all_blocks = all(t is not None for t in stored)
        from ..kernels import cpu_quant  # built only where a compiler was (the policy checked)

        self.kernels = cpu_quant
        self.run_rows = cpu_quant.gemm_rows()  # a run this long takes a call of its own

    def expert_bytes(self, expert: int) -> int:
        return self.gate_up[expert].nbytes() + self.down[expert].nbytes()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                act: GatedAct, b13: Optional[torch.Tensor] = None,
                b2: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, H]; weights [T, k] float32; ids [T, k] -> [T, H] in x's dtype; ``b13``,
        ``b2``: the experts' biases, if any (as ``torch_experts``)."""
        tokens, k = ids.shape
        flat = ids.reshape(-1)
        if tokens * k <= PAIRS_MAX:  # each (token, expert) pair its own run, token order
            order = None
            runs = [(e, p, 1) for p, e in enumerate(flat.tolist())]
        else:  # the pairs sorted by expert, a run per expert hit
            order = torch.argsort(flat, stable=True)
            runs, first = [], 0
            for e, count in enumerate(torch.bincount(flat, minlength=len(self.down)).tolist()):
                if count:
                    runs.append((e, first, count))
                    first += count
        rows = x.float()[order // k] if order is not None else x.float().repeat_interleave(k, 0)
        h = self._product(self.gate_up, runs, rows)
        chosen = flat if order is None else flat[order]
        if b13 is not None:
            h += b13[chosen].float()
        y = self._product(self.down, runs, gated(act)(h))
        if b2 is not None:
            y += b2[chosen].float()
        if order is not None:  # back to (token, choice) order
            y = torch.empty_like(y).index_copy_(0, order, y)
        # each token's k rows scaled and summed in a fixed order
        out = y.view(tokens, k, self.hidden).mul_(weights.float().unsqueeze(-1)).sum(1)
        return out.to(x.dtype)

    def _product(self, weights: nn.ModuleList, runs: list[tuple[int, int, int]],
                 rows: torch.Tensor) -> torch.Tensor:
        """Each run (expert, first row, rows) of ``rows`` times its expert's ``weights``.
        Runs of fewer than ``run_rows`` rows go to the library together, a part per run
        and projection, up to ``MAX_PARTS`` parts a call (the row dots); a longer run (a
        long prompt's) takes its ``BlockWeight``'s own call (the many-row product), as
        does every run where a part is float."""
        out = torch.empty(rows.shape[0], weights[0].out_features)
        rows = rows.contiguous()
        batched = []
        for run in runs:
            e, first, count = run
            if self.all_blocks and count < self.run_rows:
                batched.append(run)
            else:
                out[first:first + count] = weights[e](rows[first:first + count])
        per_run = len(weights[0].part_rows)
        step = self.kernels.MAX_PARTS // per_run
        for i in range(0, len(batched), step):
            chunk = batched[i:i + step]
            self.kernels.linear_rows(
                [part for e, _, _ in chunk for part in weights[e].bound().parts],
                [(first, count) for _, first, count in chunk for _ in range(per_run)],
                rows.shape[1], rows, out)
        return out

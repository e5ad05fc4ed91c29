"""A layer's routed experts kept as the checkpoint stored them: GGUF blocks on the CPU.

A quantized MoE file is mostly experts (Qwen3-30B-A3B: 29 of its 30 B parameters), so
expanding them to float would need several times the file's size in memory. Here each
expert's [gate | up] and down matrices are a ``BlockWeight`` of their own, views of
the mapped file, multiplied by the same integer kernels as a dense layer's
(``kernels/cpu_quant``): a one-token step reads only the k experts it was routed to,
in their block type.

The computation is ``torch_experts``' (``layers/moe.py``), in float32 (the CPU path's
dtype): each (token, expert) pair's [gate | up] product, the activation and the down
product, scaled by its routing weight and summed per token in a fixed order. A few pairs
(decode) take one library call per projection, each pair a row bound to its expert's
parts (``_pairs``); more are sorted by expert, one product per expert hit, an expert of
at least ``float_rows`` rows taking the float product as a dense layer's does
(``_grouped``). A decode step whose layers all bind runs this in C instead
(``kernels/cpu_layer.py``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .activation import GatedAct, gated
from .block_weight import BlockWeight

# Steps of at most this many (token, expert) pairs multiply each pair on its own row in
# one library call per projection (``_pairs``); larger ones group rows by expert, so
# that each expert's weights are read once for all its rows (``_grouped``).
PAIRS_MAX = 32


class BlockExperts(nn.Module):
    """``num_experts`` experts of ``hidden`` -> ``local`` (this rank's intermediate
    columns) -> ``hidden``; ``stored``: the block types of gate, up and down."""

    def __init__(self, num_experts: int, hidden: int, local: int,
                 stored: Sequence[Optional[int]], float_rows: int, prefill: str):
        super().__init__()
        gate, up, down = stored
        self.gate_up = nn.ModuleList(
            BlockWeight(hidden, [local, local], [gate, up], float_rows, prefill)
            for _ in range(num_experts))
        self.down = nn.ModuleList(
            BlockWeight(local, [hidden], [down], float_rows, prefill) for _ in range(num_experts))
        self.hidden = hidden
        # The pairs' one-call products need every part in a block type (a float part
        # takes torch's product, outside the library's).
        self.all_blocks = all(t is not None for t in stored)
        from ..kernels import cpu_quant  # built only where a compiler was (the policy checked)

        self.kernels = cpu_quant

    def expert_bytes(self, expert: int) -> int:
        return self.gate_up[expert].nbytes() + self.down[expert].nbytes()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                act: GatedAct, b13: Optional[torch.Tensor] = None,
                b2: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, H]; weights [T, k] float32; ids [T, k] -> [T, H] in x's dtype; ``b13``,
        ``b2``: the experts' biases, if any (as ``torch_experts``)."""
        tokens, k = ids.shape
        if tokens * k <= PAIRS_MAX and self.all_blocks:
            rows = self._pairs(x, ids)
        else:
            rows = self._grouped(x, ids)
        h = rows[0]
        if b13 is not None:
            h += b13[ids.reshape(-1)].float()
        y = rows[1](gated(act)(h))
        if b2 is not None:
            y += b2[ids.reshape(-1)].float()
        # each token's k rows scaled and summed in a fixed order
        out = y.view(tokens, k, self.hidden).mul_(weights.float().unsqueeze(-1)).sum(1)
        return out.to(x.dtype)

    def _pairs(self, x: torch.Tensor, ids: torch.Tensor):
        """A few tokens: one library call for every (token, expert) pair's [gate | up], one
        for their down products; each pair is a row, its parts bound to its expert. ->
        ([gate | up] rows [T*k, 2I], the down product of [T*k, I] rows)."""
        tokens, k = ids.shape
        experts = ids.reshape(-1).tolist()
        pairs = x.float().repeat_interleave(k, dim=0)  # row p: token p // k
        gate_up = torch.empty(len(experts), self.gate_up[0].out_features)
        parts = [part for e in experts for part in self.gate_up[e].bound().parts]
        self.kernels.linear_rows(parts, [p for p in range(len(experts)) for _ in (0, 1)],
                                 self.gate_up[0].in_features, pairs, gate_up)

        def down(h: torch.Tensor) -> torch.Tensor:
            out = torch.empty(len(experts), self.hidden)
            self.kernels.linear_rows([self.down[e].bound().parts[0] for e in experts],
                                     list(range(len(experts))), h.shape[1], h.contiguous(), out)
            return out

        return gate_up, down

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor):
        """Many tokens: rows sorted by expert, one [gate | up] and one down product per
        expert hit (the float product from ``float_rows`` rows). -> ([gate | up] rows,
        down) in (token, choice) order."""
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.down)).tolist()
        bounds = [0]
        for count in counts:
            bounds.append(bounds[-1] + count)
        picked = x.float()[order // ids.shape[1]]  # the rows in expert order, gathered once
        gate_up = torch.empty(len(order), self.gate_up[0].out_features)
        for expert, count in enumerate(counts):
            if count:
                part = slice(bounds[expert], bounds[expert + 1])
                gate_up[order[part]] = self.gate_up[expert](picked[part])

        def down(h: torch.Tensor) -> torch.Tensor:
            out = torch.empty(len(order), self.hidden)
            h = h[order]
            for expert, count in enumerate(counts):
                if count:
                    part = slice(bounds[expert], bounds[expert + 1])
                    out[order[part]] = self.down[expert](h[part])
            return out

        return gate_up, down

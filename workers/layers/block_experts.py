"""A layer's routed experts kept as the checkpoint stored them: GGUF blocks on the CPU.

A quantized MoE file is mostly experts (Qwen3-30B-A3B: 29 of its 30 B parameters), so
expanding them to float would need several times the file's size in memory. Here each
expert's [gate | up] and down matrices are a ``BlockWeight`` of their own, views of
the mapped file, multiplied by the same integer kernels as a dense layer's
(``kernels/cpu_quant``): a one-token step reads only the k experts it was routed to,
in their block type.

The computation is ``torch_experts``' (``layers/moe.py``): rows sorted by expert, one
[gate | up] product, the activation and one down product per expert hit, each row
scaled by its routing weight and summed per token, in float32 (the CPU path's dtype).
A group of at least ``float_rows`` rows (prefill) takes the float product, as a dense
layer's does.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .activation import GatedAct, gated
from .block_weight import BlockWeight


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

    def expert_bytes(self, expert: int) -> int:
        return self.gate_up[expert].nbytes() + self.down[expert].nbytes()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                act: GatedAct, b13: Optional[torch.Tensor] = None,
                b2: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, H]; weights [T, k] float32; ids [T, k] -> [T, H] in x's dtype; ``b13``,
        ``b2``: the experts' biases, if any (as ``torch_experts``)."""
        tokens, k = ids.shape
        activate = gated(act)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # stable: a token's rows keep expert order
        counts = torch.bincount(flat, minlength=len(self.down)).tolist()
        token_of = order // k
        scale = weights.reshape(-1)[order].float().unsqueeze(-1)
        xf = x.float()
        out = torch.zeros(tokens, self.hidden, dtype=torch.float32)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            part = slice(start, start + count)
            start += count
            h = self.gate_up[expert](xf[token_of[part]])
            if b13 is not None:
                h += b13[expert].float()
            y = self.down[expert](activate(h))
            if b2 is not None:
                y += b2[expert].float()
            out.index_add_(0, token_of[part], y.mul_(scale[part]))
        return out.to(x.dtype)

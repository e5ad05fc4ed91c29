"""Linear layers, the token embedding and the LM head.

A ``Linear`` may stack several checkpoint matrices along its output dimension
(q/k/v -> qkv, gate/up -> gate_up) so one matmul replaces several; ``shard(i)``
says which rows the i-th checkpoint matrix fills at load time.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


def _param(shape: Sequence[int], device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised: every parameter is filled by a loader (or the dummy init).
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_sizes: Sequence[int] | int, bias: bool,
                 device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.out_sizes = [out_sizes] if isinstance(out_sizes, int) else list(out_sizes)
        self.in_features = in_features
        self.weight = _param((sum(self.out_sizes), in_features), device, dtype)
        self.bias: Optional[nn.Parameter] = (
            _param((sum(self.out_sizes),), device, dtype) if bias else None)

    def shard(self, index: int) -> slice:
        start = sum(self.out_sizes[:index])
        return slice(start, start + self.out_sizes[index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding, optionally scaled (Gemma multiplies by sqrt(hidden_size))."""

    def __init__(self, vocab_size: int, hidden_size: int, device: torch.device,
                 dtype: torch.dtype, scale: Optional[float] = None):
        super().__init__()
        self.weight = _param((vocab_size, hidden_size), device, dtype)
        # The scale is rounded to the model dtype first, as the reference does.
        self.scale = None if scale is None else torch.tensor(scale, dtype=dtype).item()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.weight)
        return x if self.scale is None else x * self.scale


class LMHead(nn.Module):
    """hidden -> vocabulary logits (float32), optionally soft-capped; may share the embedding."""

    def __init__(self, hidden_size: int, vocab_size: int, device: torch.device,
                 dtype: torch.dtype, tied_to: Optional[Embedding] = None,
                 softcap: Optional[float] = None):
        super().__init__()
        self.tied_to = tied_to
        self.weight = None if tied_to is not None else _param((vocab_size, hidden_size), device, dtype)
        self.softcap = softcap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        logits = F.linear(hidden, weight).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

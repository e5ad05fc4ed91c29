"""RMSNorm, computed in float32 whatever the model dtype (as the reference models do)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import fused_kernel


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``. Gemma's ``(1 + w)`` form is folded into ``weight`` at load."""

    def __init__(self, dim: int, eps: float, device: torch.device):
        super().__init__()
        self.dim, self.eps = dim, eps
        # Norm weights stay float32: they are tiny and bf16 would round Gemma's 1 + w.
        self.weight = nn.Parameter(torch.ones(dim, device=device), requires_grad=False)
        self.kernel = fused_kernel(device, "rmsnorm", "rms_norm")  # one launch, not four
        self.add_kernel = fused_kernel(device, "rmsnorm", "add_rms_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.dim,), self.weight, self.eps)
        return F.rms_norm(x.float(), (self.dim,), self.weight, self.eps).to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``, the sum in x's dtype: a decoder layer's
        residual add and the norm after it, one launch on the GPU path."""
        if self.add_kernel is not None:
            return self.add_kernel(x, residual, self.weight, self.eps)
        residual = x + residual
        return self(residual), residual

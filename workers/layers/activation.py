"""Gated MLP activations applied to a fused [gate | up] projection."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Union

import torch
import torch.nn.functional as F

from pocketllm.errors import UnsupportedFeatureError

from ..models.config import ACTIVATION_KINDS


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_TORCH: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_tanh": _gelu_tanh, "gelu": F.gelu}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATION_KINDS:
        raise UnsupportedFeatureError(
            f"activation {name!r} is not supported; known: {', '.join(sorted(ACTIVATION_KINDS))}")
    return _TORCH[ACTIVATION_KINDS[name]]


def act_and_mul(act: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up, where gate_up = [gate | up] along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation on [gate | up]: the gate clamped above at ``limit``, up
    clamped to [-limit, limit], then ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


# What a gated MLP applies to its [gate | up] rows: an HF ``hidden_act`` name (act(gate) * up)
# or a callable of the whole [gate | up] (ClampedSwiGLU).
GatedAct = Union[str, Callable[[torch.Tensor], torch.Tensor]]


def gated(act: GatedAct) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function of [gate | up] that ``act`` names."""
    if callable(act):
        return act
    return functools.partial(act_and_mul, get_activation(act))

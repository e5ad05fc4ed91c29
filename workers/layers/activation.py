"""Gated MLP activations applied to a fused [gate | up] projection."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from pocketllm.errors import UnsupportedFeatureError


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu": F.gelu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise UnsupportedFeatureError(
            f"activation {name!r} is not supported; known: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


def act_and_mul(act: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up, where gate_up = [gate | up] along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up

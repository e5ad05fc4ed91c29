"""Where each checkpoint tensor goes: ``WeightTarget`` (a parameter's rows and the shard of
the checkpoint tensor this rank reads), and the targets of
the layer shapes every family shares (fused q/k/v and gate/up, row-parallel products,
the padded vocabulary)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..layers.linear import ColumnParallelLinear, RowParallelLinear, Shard


@dataclass
class WeightTarget:
    """Where one checkpoint tensor goes: its part ``shard`` (None: all of it) fills rows
    ``rows`` of ``param`` (None: all of it), after ``transform``."""

    param: torch.Tensor
    rows: Optional[slice] = None
    transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    shard: Optional[Shard] = None
    # The whole checkpoint tensor's shape where ``transform`` reshapes it (a transpose),
    # or where the destination holds its blocks; None: the destination's, with the
    # shard's dimension at full size.
    stored_shape: Optional[tuple[int, ...]] = None
    # The GGUF block type the destination holds as stored (``linear_method.GGUF_BLOCKS``):
    # the tensor's bytes are copied, never decoded. None: float values.
    ggml_type: Optional[int] = None
    # Float values stored otherwise (``linear_method.FP8``): called with this rank's part
    # and ``rows`` in place of a copy.
    quantize: Optional[Callable[[torch.Tensor, Optional[slice]], None]] = None
    # Built by the layer's linear method (``part_target``): only a layer whose every
    # tensor arrives so may hold its weight other than as one float parameter.
    by_method: bool = False

    def write(self, value: torch.Tensor) -> None:
        """Store this rank's part of the tensor (float values, or a block target's bytes)."""
        if self.quantize is not None:
            self.quantize(value, self.rows)
        else:
            self.dest.copy_(value)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the destination (this rank's part)."""
        return tuple(self.param[self.rows].shape if self.rows is not None else self.param.shape)

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        """The shape the whole checkpoint tensor must have."""
        if self.stored_shape is not None:
            return self.stored_shape
        shape = list(self.shape)
        if self.shard is not None:
            shape[self.shard.dim] = self.shard.full
        return tuple(shape)

    @property
    def dest(self) -> torch.Tensor:
        return self.param if self.rows is None else self.param[self.rows]


def vocab_target(param: torch.Tensor, shard: Shard) -> WeightTarget:
    # The vocabulary is padded per rank: only the first shard.size rows are real.
    if shard.whole and shard.size == param.shape[0]:
        return WeightTarget(param)
    return WeightTarget(param, slice(0, shard.size), shard=None if shard.whole else shard)


def stacked_targets(t: dict[str, WeightTarget], prefix: str, names: tuple[str, ...],
                     layer: ColumnParallelLinear) -> None:
    """q/k/v or gate/up: each checkpoint matrix fills its rows of the fused parameter."""
    for j, name in enumerate(names):
        t[f"{prefix}{name}.weight"] = layer.part_target(j)
        if layer.bias is not None:
            t[f"{prefix}{name}.bias"] = WeightTarget(layer.bias, layer.out_rows(j),
                                                     shard=layer.part_shard(j))


def row_parallel_targets(t: dict[str, WeightTarget], prefix: str,
                          layer: RowParallelLinear) -> None:
    t[f"{prefix}weight"] = layer.part_target()
    if layer.bias is not None:
        t[f"{prefix}bias"] = WeightTarget(layer.bias)  # replicated: added after the sum

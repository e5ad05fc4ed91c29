"""A linear layer's weight kept as the checkpoint stored it: GGUF blocks, multiplied on the CPU
by integer kernels (``kernels/cpu_quant``), never expanded to float.

A layer's weight is a stack of checkpoint matrices (q/k/v, gate/up, or one), and a GGUF
file may store them in different types (a Q4_K_M file mixes Q5_0, Q8_0, Q4_K and Q6_K).
So each stacked part keeps its own type and bytes, and a product is one kernel call per
part, each writing its columns of one output. A float part (an F16 matrix) stays a
float32 matrix and takes torch's product.

A product quantizes the input rows to 16 bits once (per block of 32) and every block
part's integer kernel reads them, in one library call: a few rows (decode) through the
row dots, many (a prompt) through the library's many-row product, which decodes each
weight row once for all of them (docs/cpu_kernels.md). Which layers store blocks is the
kernel policy's call (``KernelPolicy``); this is the storage and the product.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from pocketllm.errors import CheckpointError

from ..loader.gguf_quants import GGML_TYPES, type_name


class BlockWeight(nn.Module):
    """Parts of ``part_rows`` rows each, stacked along the output; ``part_types[j]`` is the
    GGML type part j is stored in (None: a float part)."""

    def __init__(self, in_features: int, part_rows: Sequence[int],
                 part_types: Sequence[Optional[int]]):
        super().__init__()
        from ..kernels import cpu_quant  # built only where a compiler was (the policy checked)

        self.kernels = cpu_quant
        self.in_features = in_features
        self.part_rows = list(part_rows)
        self.part_types = list(part_types)
        self.out_features = sum(self.part_rows)
        bounds = [0]
        for rows in self.part_rows:
            bounds.append(bounds[-1] + rows)
        self.columns = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
        # Filled by load_part: uint8 (rows, row_bytes) for a block part, float32 (rows, K)
        # for a float part. Buffers, so that they count as the model's storage.
        for j in range(len(self.part_rows)):
            self.register_buffer(f"part{j}", None, persistent=False)
        self._bound = None  # the block parts bound for the integer kernels (first product)

    def part(self, j: int) -> torch.Tensor:
        return getattr(self, f"part{j}")

    def load_part(self, j: int, tensor, shard=None) -> None:
        """Keep this rank's part (``shard``, None: all) of checkpoint tensor j: a
        ``BlockTensor``'s bytes as they are, or a float tensor's values as float32."""
        rows, kind = self.part_rows[j], self.part_types[j]
        if kind is None:
            if isinstance(tensor, np.ndarray):  # a GGUF file's float tensor
                tensor = torch.from_numpy(tensor)
            if not isinstance(tensor, torch.Tensor):  # lazy: torch or numpy comes back
                tensor = torch.as_tensor(tensor.read(shard))
            elif shard is not None:
                tensor = shard.take(tensor)
            value = tensor.float().contiguous()
            expected = (rows, self.in_features)
        else:
            if getattr(tensor, "ggml_type", None) != kind:
                raise CheckpointError(f"part {j} of a layer stored as {type_name(kind)} came "
                                      f"as {getattr(tensor, 'type_name', type(tensor).__name__)}")
            value = torch.from_numpy(tensor.part(shard))
            _, block_elems, block_bytes = GGML_TYPES[kind]
            expected = (rows, self.in_features // block_elems * block_bytes)
        if tuple(value.shape) != expected:
            raise CheckpointError(f"part {j} has shape {tuple(value.shape)}, expected {expected}")
        setattr(self, f"part{j}", value)
        self._bound = None

    def nbytes(self) -> int:
        return sum(self.part(j).nbytes for j in range(len(self.part_rows))
                   if self.part(j) is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ W.T -> [M, out_features] float32 (the CPU path's dtype)."""
        x = x.float().contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        if any(kind is not None for kind in self.part_types):  # every block part, one call
            self.bound()(x, out)
        for j, cols in enumerate(self.columns):
            if self.part_types[j] is None:
                out[:, cols] = x @ self.part(j).t()
        return out

    def bound(self):
        """The block parts bound for the integer kernels (``cpu_quant.BlockLinear``)."""
        if self._bound is None:  # bound after loading: the parts' storage no longer changes
            self._bound = self.kernels.BlockLinear(self.in_features, [
                (kind, self.part(j), self.columns[j].start)
                for j, kind in enumerate(self.part_types) if kind is not None])
        return self._bound

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of a one-part weight as float32 [n, K]: the embedding's lookup."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        kind, w = self.part_types[0], self.part(0)
        if kind is None:
            return w.index_select(0, ids)
        out = torch.empty(ids.numel(), self.in_features, dtype=torch.float32)
        self.kernels.dequantize_rows(kind, w, self.in_features, ids, out)
        return out

    def extra_repr(self) -> str:
        types = ", ".join("float" if t is None else type_name(t) for t in self.part_types)
        return f"in={self.in_features}, parts={self.part_rows} ({types})"

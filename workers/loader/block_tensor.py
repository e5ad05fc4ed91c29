"""A checkpoint tensor kept in its GGUF block type: the bytes as the file stores them.

GGUF lays a matrix out row by row (a row is one HF output feature), each row a run of
fixed-size blocks along the input features. So this rank's part of a matrix is a
slice of rows (column-parallel: whole rows) or of block columns (row-parallel: the
input split must fall on block boundaries), both without decoding a value.

A ``BlockTensor`` is also a lazy tensor (``shape`` + ``read``): the torch worker, whose
weights are all float, reads it dequantized, as numpy (this module and ``gguf.py`` need
no torch: the torch-free worker binds the blocks themselves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from pocketllm.errors import CheckpointError, UnsupportedFeatureError

from .gguf_quants import GGML_TYPES, dequantize, type_name

if TYPE_CHECKING:
    from ..layers.linear import Shard


@dataclass
class BlockTensor:
    """A matrix (or vector) of one GGUF block type; never a float type (those load dense)."""

    ggml_type: int
    shape: tuple[int, ...]  # HF order: (rows, cols), or (n,) for a vector
    blocks: np.ndarray  # uint8 (rows, row_bytes): a view of the file's map, or generated
    name: str = ""  # the file's tensor name, for errors

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def block_elems(self) -> int:
        return GGML_TYPES[self.ggml_type][1]

    @property
    def block_bytes(self) -> int:
        return GGML_TYPES[self.ggml_type][2]

    def part(self, shard: Optional["Shard"]) -> np.ndarray:
        """This rank's bytes (rows, row_bytes of the part): a view (strided where the part
        is block columns). ``blocks`` may also be a torch tensor (random blocks drawn on a
        GPU: ``loader/dummy.py``)."""
        if shard is None or shard.whole:
            return self.blocks
        if shard.dim == 0:
            return self.blocks[shard.start:shard.stop]
        if shard.start % self.block_elems or shard.stop % self.block_elems:
            raise UnsupportedFeatureError(
                f"tensor {self.name or '?'!r}: a {self.type_name} matrix's input features "
                f"[{shard.start}, {shard.stop}) do "
                f"not fall on its blocks of {self.block_elems}: choose a tensor_parallel_size "
                "that splits the input dimension at a multiple of the block size",
                "tensor_parallel_size")
        lo, hi = (i // self.block_elems * self.block_bytes for i in (shard.start, shard.stop))
        return self.blocks[:, lo:hi]

    def read(self, shard: Optional["Shard"] = None) -> np.ndarray:
        """This rank's part, dequantized to float32 (the dense fallback)."""
        raw = self.part(shard)
        cols = raw.shape[1] // self.block_bytes * self.block_elems
        values = dequantize(np.ascontiguousarray(raw).reshape(-1), self.ggml_type)
        return values.reshape(raw.shape[0], cols) if len(self.shape) == 2 else values

    def with_rows(self, order: np.ndarray) -> "BlockTensor":
        """The same matrix with its rows reordered (a copy): undoes a converter's permutation."""
        return BlockTensor(self.ggml_type, self.shape, self.blocks[order], self.name)


def block_tensor(data: np.ndarray, ggml_type: int, shape: tuple[int, ...], offset: int,
                 name: str, path: str) -> BlockTensor:
    """The tensor ``name`` of a mapped GGUF file, checked against the file's size."""
    _, block_elems, block_bytes = GGML_TYPES[ggml_type]
    cols = shape[-1]
    if cols % block_elems:
        raise CheckpointError(f"{path!r}: tensor {name!r} of shape {shape} does not split into "
                              f"{type_name(ggml_type)} blocks of {block_elems}")
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    row_bytes = cols // block_elems * block_bytes
    if offset + rows * row_bytes > data.size:
        raise CheckpointError(f"{path!r} is truncated: tensor {name!r} ends past the end of the file")
    blocks = data[offset:offset + rows * row_bytes].reshape(rows, row_bytes)
    return BlockTensor(ggml_type, shape, blocks, name)

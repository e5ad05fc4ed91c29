"""HF safetensors checkpoints: one file, or shards listed by model.safetensors.index.json."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from pocketllm.errors import CheckpointError

if TYPE_CHECKING:
    from ..layers.linear import Shard

INDEX_NAME = "model.safetensors.index.json"


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read {index!r}: {e}") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise CheckpointError(f"{index!r} lists shard {name!r}, which is missing")
        return [os.path.join(path, name) for name in files]
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path!r} holds no .safetensors file")
    return [os.path.join(path, name) for name in files]


class SafetensorsSlice:
    """One tensor of an open file, read only when asked and only the part asked for
    (safetensors maps the file, so a row or column range touches only its bytes)."""

    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self.dtype = self._slice.get_dtype()  # safetensors' name: "BF16", "F8_E4M3", ...

    def read(self, shard: Optional["Shard"] = None) -> torch.Tensor:
        if shard is None:
            return self._slice[:]
        index = [slice(None)] * len(self.shape)
        index[shard.dim] = slice(shard.start, shard.stop)
        return self._slice[tuple(index)]


def load_safetensors_weights(path: str, lazy: bool = False
                             ) -> Iterator[tuple[str, "torch.Tensor | SafetensorsSlice"]]:
    """Yield (HF name, tensor) one file at a time, so peak memory is one file's tensor.

    ``lazy``: yield ``SafetensorsSlice``s instead, which the model reads only in the
    part this rank holds (valid until the next item is asked for).
    """
    from safetensors import safe_open
    from safetensors import SafetensorError

    for file in safetensors_files(path):
        try:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, SafetensorsSlice(handle, name) if lazy else handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {file!r}: {e}") from None

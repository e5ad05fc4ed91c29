"""HF safetensors checkpoints: one file, or shards listed by model.safetensors.index.json."""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch

from pocketllm.errors import CheckpointError

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


def load_safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) one shard at a time, so peak memory is one shard."""
    from safetensors import safe_open
    from safetensors import SafetensorError

    for file in safetensors_files(path):
        try:
            with safe_open(file, framework="pt", device="cpu") as shard:
                for name in shard.keys():
                    yield name, shard.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {file!r}: {e}") from None

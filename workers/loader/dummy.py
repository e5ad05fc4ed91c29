"""Random weights from config.json alone (``load_format="dummy"``), for benchmarks and tests."""

from __future__ import annotations

import torch

from ..models.base import CausalLM
from .block_tensor import BlockTensor
from .dummy_blocks import SCALE_FIELDS
from .gguf_quants import GGML_TYPES

DUMMY_STD = 0.02  # small, so activations and logits stay in a sane range


def init_dummy_weights(model: CausalLM, seed: int, std: float = DUMMY_STD) -> None:
    """Deterministic in ``seed`` and the device type: drawn in a fixed order on the model's
    own device (a host draw of 8B weights takes a minute; a GPU's, a second).

    Every rank draws each whole tensor and keeps its part, so the model is the same
    whatever the tensor-parallel size.
    """
    device = model.device
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, target in sorted(model.weight_targets().items()):
            shape = target.checkpoint_shape
            if target.ggml_type is not None:  # a layer that keeps GGUF blocks
                blocks = BlockTensor(target.ggml_type, shape,
                                     _random_blocks(target.ggml_type, shape, gen, device), name)
                target.write(blocks.part(target.shard))
                continue
            if name.endswith("norm.weight"):  # identity norms (Gemma stores w of 1 + w)
                fill = 0.0 if target.transform is not None else 1.0
                value = torch.full(shape, fill, device=device)
            elif name.endswith(".bias"):
                value = torch.zeros(shape, device=device)
            else:
                value = torch.randn(shape, generator=gen, device=device).mul_(std)
            if target.shard is not None:
                value = target.shard.take(value)
            if target.transform is not None:
                value = target.transform(value)
            target.write(value)



def _random_blocks(ggml_type: int, shape: tuple[int, int], gen: torch.Generator,
                   device: torch.device) -> torch.Tensor:
    """``dummy_blocks.random_block_tensor``'s blocks (random codes, the type's fixed
    scales), drawn on ``device``: uint8 [rows, row_bytes]."""
    name, per, size = GGML_TYPES[ggml_type]
    rows, cols = shape
    raw = torch.randint(0, 256, (rows * (cols // per), size), generator=gen, device=device,
                        dtype=torch.uint8)
    offsets, d, centre = SCALE_FIELDS[name.lower()]
    for offset, value in zip(offsets, (d, centre * d)):
        raw[:, offset:offset + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8)
    return raw.view(rows, cols // per * size)

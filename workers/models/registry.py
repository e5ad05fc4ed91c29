"""The worker's half of the model registry: the family a checkpoint's architecture belongs
to (``pocketllm/families.py``) names its model class and config parser by module path;
they are imported here, when a checkpoint of that family is built."""

from __future__ import annotations

import torch

from pocketllm.model_info import ModelInfo

from ..layers.attention import AttentionBackend
from ..distributed import SINGLE, TPGroup
from .base import CausalLM
from .config import ArchConfig, arch_config, resolve


def build_model(info: ModelInfo, backend: AttentionBackend, device: torch.device,
                dtype: torch.dtype, tp: TPGroup = SINGLE) -> CausalLM:
    """An uninitialised model of the checkpoint's architecture (weights come from a loader),
    holding this rank's share of every split layer."""
    return resolve(info, "model")(arch_config(info), backend, device, dtype, tp)


def checkpoint_shapes(info: ModelInfo) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the checkpoint must hold (a model built on the meta
    device: no memory, no kernels)."""
    from ..layers.attention import TorchAttention

    model = build_model(info, TorchAttention(), torch.device("meta"), torch.float32)
    return {name: target.checkpoint_shape for name, target in model.weight_targets().items()}

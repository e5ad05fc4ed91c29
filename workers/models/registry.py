"""The one model registry: checkpoint architecture -> model class and config parser."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from pocketllm.errors import UnsupportedFeatureError
from pocketllm.model_info import ModelInfo

from ..layers.attention import AttentionBackend
from ..distributed import SINGLE, TPGroup
from .base import CausalLM
from .config import ArchConfig
from .gemma3 import Gemma3ForCausalLM, gemma3_arch_config
from .llama import LlamaForCausalLM, llama_arch_config
from .qwen3_moe import Qwen3MoeForCausalLM, qwen3_moe_arch_config

ConfigParser = Callable[[dict, str], ArchConfig]

MODELS: dict[str, tuple[type[CausalLM], ConfigParser]] = {
    "LlamaForCausalLM": (LlamaForCausalLM, llama_arch_config),
    "MistralForCausalLM": (LlamaForCausalLM, llama_arch_config),
    "Qwen2ForCausalLM": (LlamaForCausalLM, llama_arch_config),
    "Qwen3ForCausalLM": (LlamaForCausalLM, llama_arch_config),
    "Gemma3ForCausalLM": (Gemma3ForCausalLM, gemma3_arch_config),
    "Gemma3ForConditionalGeneration": (Gemma3ForCausalLM, gemma3_arch_config),
    "Qwen3MoeForCausalLM": (Qwen3MoeForCausalLM, qwen3_moe_arch_config),
}


def arch_config(info: ModelInfo) -> ArchConfig:
    if info.architecture not in MODELS:
        raise UnsupportedFeatureError(
            f"architecture {info.architecture!r} has no model here; "
            f"supported: {', '.join(sorted(MODELS))}")
    _cls, parse = MODELS[info.architecture]
    cfg = parse(info.hf_config, info.architecture)
    cfg.validate()
    return cfg


def build_model(info: ModelInfo, backend: AttentionBackend, device: torch.device,
                dtype: torch.dtype, tp: TPGroup = SINGLE,
                weight_types: Optional[dict[str, int]] = None) -> CausalLM:
    """An uninitialised model of the checkpoint's architecture (weights come from a loader),
    holding this rank's share of every split layer; ``weight_types``: the block types the
    checkpoint stores tensors in (``ArchConfig.weight_types``)."""
    cfg = arch_config(info)
    cfg.weight_types = dict(weight_types or {})
    cls, _parse = MODELS[info.architecture]
    return cls(cfg, backend, device, dtype, tp)


def checkpoint_shapes(info: ModelInfo) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the checkpoint must hold (a model built on the meta
    device: no memory, no kernels)."""
    from ..layers.attention import TorchAttention

    model = build_model(info, TorchAttention(), torch.device("meta"), torch.float32)
    return {name: target.checkpoint_shape for name, target in model.weight_targets().items()}

"""Llama 2/3, Mistral, Qwen2 and Qwen3: one pre-norm decoder, told apart by config flags.

Qwen2 adds q/k/v biases; Qwen3 adds per-head q/k RMSNorm; Mistral may slide its
window over every layer; Qwen may slide it over layers >= max_window_layers.
"""

from __future__ import annotations

import torch

from ..distributed import TPGroup
from ..layers.attention import AttentionBackend
from .base import CausalLM, DecoderLayer, GatedMLP, PreNormDecoderLayer
from .config import ArchConfig

class LlamaForCausalLM(CausalLM):
    def make_layer(self, cfg: ArchConfig, index: int, backend: AttentionBackend,
                   device: torch.device, dtype: torch.dtype, tp: TPGroup) -> DecoderLayer:
        return PreNormDecoderLayer(cfg, index, backend, device, dtype, tp,
                                   GatedMLP(cfg, device, dtype, tp))

"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k norm) with
routed experts in place of the MLP (``layers/moe.FusedMoE``: softmax top-k routing,
renormalised when ``norm_topk_prob``).

Which layers are sparse, and the config's defaults: ``qwen3_moe_config.py``. Qwen3-MoE has
no shared experts.
"""

from __future__ import annotations

import torch

from ..distributed import TPGroup
from ..layers.attention import AttentionBackend
from ..layers.moe import FusedMoE, softmax_topk
from .base import CausalLM, DecoderLayer, GatedMLP, PreNormDecoderLayer
from .config import MoeArchConfig


class Qwen3MoeForCausalLM(CausalLM):
    def make_layer(self, cfg: MoeArchConfig, index: int, backend: AttentionBackend,
                   device: torch.device, dtype: torch.dtype, tp: TPGroup) -> DecoderLayer:
        mlp = (FusedMoE(cfg.hidden_size, cfg.moe, softmax_topk(cfg.moe.norm_topk_prob), device,
                        dtype, tp)
               if cfg.sparse_layers[index] else GatedMLP(cfg, device, dtype, tp))
        return PreNormDecoderLayer(cfg, index, backend, device, dtype, tp, mlp)

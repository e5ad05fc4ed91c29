"""Gemma 3 (text): sandwich norms, (1 + w) RMSNorm, scaled embedding, q/k norm,
sliding-window local layers with their own rope base, optional logit soft-capping.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..distributed import TPGroup
from ..layers.attention import AttentionBackend
from ..layers.norm import RMSNorm
from .base import Attention, CausalLM, DecoderLayer, GatedMLP
from .weight_targets import WeightTarget
from .config import ArchConfig

# Multimodal checkpoints nest the text model; the vision tower is not served.
_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
             ("language_model.lm_head.", "lm_head."))
_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
            "model.multi_modal_projector.")


class Gemma3DecoderLayer(DecoderLayer):
    norm_names = ("input_layernorm", "post_attention_layernorm",
                  "pre_feedforward_layernorm", "post_feedforward_layernorm")

    def __init__(self, cfg: ArchConfig, index: int, backend: AttentionBackend,
                 device: torch.device, dtype: torch.dtype, tp: TPGroup):
        super().__init__()
        self.self_attn = Attention(cfg, index, backend, device, dtype, tp)
        self.mlp = GatedMLP(cfg, device, dtype, tp)
        for name in self.norm_names:
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device))

    def post_attention(self, attn: torch.Tensor, residual: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.post_attention_layernorm(self.self_attn.output(attn))
        h, residual = self.mlp.normed(self.pre_feedforward_layernorm, attn, residual)
        return self.post_feedforward_layernorm(h), residual


class Gemma3ForCausalLM(CausalLM):
    def make_layer(self, cfg: ArchConfig, index: int, backend: AttentionBackend,
                   device: torch.device, dtype: torch.dtype, tp: TPGroup) -> DecoderLayer:
        return Gemma3DecoderLayer(cfg, index, backend, device, dtype, tp)

    def weight_targets(self) -> dict[str, WeightTarget]:
        targets = super().weight_targets()
        offset = self.cfg.norm_weight_offset  # checkpoints store w of (1 + w)
        for name, target in targets.items():
            if name.endswith("norm.weight"):
                target.transform = lambda weight: weight + offset
        return targets

    def canonical_name(self, name: str) -> Optional[str]:
        if name.startswith(_SKIPPED):
            return None
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        return super().canonical_name(name)

"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next: hybrid models whose layers are Gated DeltaNet
linear attention (``layers/linear_attention.py``, a recurrent state per sequence) or gated
full attention (a sigmoid gate per query-head dimension on the attention output, a
partial rotary, q/k norms), each followed by a dense MLP or routed experts plus a gated
shared expert. Norms are (1 + w), folded at load as Gemma's. The config:
``qwen3_5_config.py``.

A multimodal checkpoint (``Qwen3_5ForConditionalGeneration``) is served by its text
tower: the language model's tensors are renamed, the vision tower's skipped. The
multi-token-prediction (MTP) layer checkpoints ship is loaded where it drafts
(``speculative_method="mtp"``: ``mtp_layer.py``), else skipped with a log line.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional

import torch
from torch import nn

from pocketllm.errors import UnsupportedFeatureError

from ..distributed import SINGLE, TPGroup
from ..kernels import fused_kernel
from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.linear import ColumnParallelLinear, Shard
from ..layers.linear_attention import GatedDeltaNet
from ..layers.moe import FusedMoE, softmax_topk
from ..layers.norm import RMSNorm
from ..layers.rotary import apply_rotary
from .base import Attention, CausalLM, DecoderLayer, GatedMLP, PreNormDecoderLayer, RopeCosSin
from .qwen3_5_config import HybridArchConfig
from .mtp_layer import MTPLayer, MTPNames
from .weight_targets import WeightTarget

logger = logging.getLogger("pocketllm.worker")

_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."))
_SKIPPED = ("model.visual.", "visual.", "model.vision_tower.")
_MTP = ("mtp.", "model.mtp.")
MTP_NAMES = MTPNames("mtp.", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "layers.0.",
                     "norm")


class GatedAttention(Attention):
    """q_proj emits, per query head, the head's query then its output gate (``q_per_head``);
    the attention output is scaled by sigmoid(gate) before o_proj."""

    q_per_head = 2

    def __init__(self, cfg: HybridArchConfig, layer: int, backend: AttentionBackend,
                 device: torch.device, dtype: torch.dtype, tp: TPGroup = SINGLE):
        super().__init__(cfg, layer, backend, device, dtype, tp)
        self.gate_kernel = fused_kernel(device, "gated_act", "sigmoid_gate_")

    def project(self, norm: RMSNorm, x: torch.Tensor, residual: Optional[torch.Tensor],
                rope: RopeCosSin):
        """-> q, k, v, gate, residual."""
        qkv, residual = self.qkv_proj.normed(norm, x, residual)
        t, d = qkv.shape[0], self.head_dim
        q_gate, k, v = qkv.split(self.split, dim=-1)
        q_gate = q_gate.view(t, self.num_heads, 2 * d)
        q, gate = q_gate[..., :d], q_gate[..., d:]
        k, v = k.view(t, self.num_kv_heads, d), v.reshape(t, self.num_kv_heads, d)
        if self.rotary_kernel is not None:  # the q/k norms and the partial rotary, one launch
            return (*self.rotary_kernel(q, k, *rope, self.qk_norms), v, gate, residual)
        q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, *rope), apply_rotary(k, *rope), v, gate, residual

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor,
               meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]
               ) -> torch.Tensor:
        out = super().attend(q, k, v, meta, kv_cache)
        if self.gate_kernel is not None and out.stride(-1) == 1:  # one launch, in place
            return self.gate_kernel(out, gate)
        return out * torch.sigmoid(gate)


class SharedExpertMoE(nn.Module):
    """Routed experts plus one always-on shared expert whose output sigmoid(x . w) scales;
    both partial sums are added before the one all-reduce."""

    def __init__(self, cfg: HybridArchConfig, device: torch.device, dtype: torch.dtype,
                 tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.experts = FusedMoE(cfg.hidden_size, cfg.moe, softmax_topk(cfg.moe.norm_topk_prob),
                                device, dtype, tp)
        self.shared_expert = GatedMLP(replace(cfg, intermediate_size=cfg.shared_expert_size),
                                      device, dtype, tp)
        self.shared_expert_gate = ColumnParallelLinear(cfg.hidden_size, [Shard(0, 0, 1, 1)],
                                                       False, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, reduce=False)
        return self.tp.all_reduce(self.experts(x, reduce=False) + shared)

    def normed(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm.add(x, residual)
        return self(h), residual

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        t = self.experts.weight_targets(prefix)
        t.update(self.shared_expert.weight_targets(f"{prefix}shared_expert."))
        t[f"{prefix}shared_expert_gate.weight"] = WeightTarget(self.shared_expert_gate.weight)
        return t


class Qwen3_5ForCausalLM(CausalLM):
    def build_mtp(self, backend: AttentionBackend) -> MTPLayer:
        if self.cfg.mtp_layers < 1:
            raise UnsupportedFeatureError(
                f"speculative_method='mtp': this {self.cfg.architecture} checkpoint has no "
                "MTP layer (its config's mtp_num_hidden_layers is 0 or absent)",
                "speculative_method")
        # one layer of full attention, routed where the target routes its layers
        cfg = replace(self.cfg, num_layers=1, layer_windows=[None], layer_rope=["default"],
                      linear_layers=[False], sparse_layers=[any(self.cfg.sparse_layers)])
        self.mtp = MTPLayer(self, backend, cfg, MTP_NAMES)
        return self.mtp

    def make_layer(self, cfg: HybridArchConfig, index: int, backend: AttentionBackend,
                   device: torch.device, dtype: torch.dtype, tp: TPGroup) -> DecoderLayer:
        if cfg.linear_layers[index]:
            mixer = GatedDeltaNet(cfg.hidden_size, cfg.gdn, cfg.rms_norm_eps, device, dtype, tp)
        else:
            mixer = GatedAttention(cfg, index, backend, device, dtype, tp)
        mlp = (SharedExpertMoE(cfg, device, dtype, tp) if cfg.sparse_layers[index]
               else GatedMLP(cfg, device, dtype, tp))
        return PreNormDecoderLayer(cfg, index, backend, device, dtype, tp, mlp, attention=mixer)

    def layer_weight_targets(self, p: str, layer: DecoderLayer) -> dict[str, WeightTarget]:
        if not isinstance(layer.self_attn, GatedDeltaNet):
            return super().layer_weight_targets(p, layer)
        t = layer.self_attn.weight_targets(f"{p}linear_attn.")
        t.update(layer.mlp.weight_targets(f"{p}mlp."))
        for norm in layer.norm_names:
            t[f"{p}{norm}.weight"] = WeightTarget(getattr(layer, norm).weight)
        return t

    def weight_targets(self) -> dict[str, WeightTarget]:
        targets = super().weight_targets()
        offset = self.cfg.norm_weight_offset  # checkpoints store w of (1 + w)
        for name, target in targets.items():
            # every RMSNorm but the linear-attention output norm, which scales by w itself
            if ((name.endswith("norm.weight") or ".pre_fc_norm_" in name)
                    and ".linear_attn." not in name):
                target.transform = lambda weight: weight + offset
        return targets

    def canonical_name(self, name: str) -> Optional[str]:
        if name.startswith(_SKIPPED):
            return None
        if name.startswith(_MTP):
            return self.mtp_tensor("mtp." + name.split("mtp.", 1)[1])
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        return super().canonical_name(name)

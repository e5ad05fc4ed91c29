"""The multi-token-prediction (MTP) layer a checkpoint ships beside its model (Qwen3.5,
Qwen3.5-MoE and Qwen3-Next: ``mtp.*``; DeepSeek-V3: ``model.layers.{L}.*`` past the last
layer), run by the worker as the drafter of ``speculative_method="mtp"``
(``workers/mtp_proposer.py``).

Row t reads the target's hidden state at t (after its final norm) and the embedding of
token t + 1; each is normed, the two are joined (embedding first) and projected back to
the hidden width; one decoder layer of the target's kind (its attention, full: gated
attention or MLA; its dense MLP or experts) with its own KV cache; a norm. The target's
LM head turns the result into the guess of token t + 2, and the result itself stands in
for the target's hidden state when the layer guesses one more. The embedding and the
head are the target's (DeepSeek-V3 stores copies of both with the layer: not loaded).
The families differ only in where the tensors are (``MTPNames``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pocketllm.errors import UnsupportedFeatureError

from ..layers.attention import AttentionMetadata
from ..layers.linear import ColumnParallelLinear, Shard
from ..layers.norm import RMSNorm
from .weight_targets import WeightTarget


@dataclass(frozen=True)
class MTPNames:
    """Where a checkpoint keeps the layer: under ``prefix``, the embedding's and the hidden
    state's norms, the projection over both, the decoder layer's own names (after
    ``layer``), the closing norm; ``shared``: copies of the target's tensors, not loaded."""

    prefix: str
    embedding_norm: str
    hidden_norm: str
    fc: str
    layer: str
    norm: str
    shared: tuple[str, ...] = ()

    def is_shared(self, name: str) -> bool:
        return name[len(self.prefix):].startswith(self.shared) if self.shared else False


class MTPLayer(nn.Module):
    def __init__(self, target, backend, layer_cfg, names: MTPNames):
        """``target``: the model whose checkpoint holds the layer; ``layer_cfg``: the
        target's config cut to the one layer (full attention, routed where the target
        routes)."""
        super().__init__()
        cfg, device, dtype = target.cfg, target.device, target.dtype
        if target.tp.world != 1:
            raise UnsupportedFeatureError("the MTP drafter runs at tensor-parallel size 1",
                                          "speculative_method")
        self.names = names
        h = cfg.hidden_size
        self.norm_embedding = RMSNorm(h, cfg.rms_norm_eps, device)
        self.norm_hidden = RMSNorm(h, cfg.rms_norm_eps, device)
        self.fc = ColumnParallelLinear(2 * h, [Shard(0, 0, h, h)], False, device, dtype)
        self.layer = target.make_layer(layer_cfg, 0, backend, device, dtype, target.tp)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, device)
        self._target = (target,)  # not a submodule: its parameters are the target's own

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int,
                hidden: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``input_ids`` [T] (token t + 1 of each row), ``hidden`` [T, H] (the target's
        normed hidden state at t, or a previous guess's ``forward``) -> [T, H], whose
        ``logits`` guess token t + 2."""
        target = self._target[0]
        x = torch.cat([self.norm_embedding(target.embed_tokens(input_ids)),
                       self.norm_hidden(hidden)], dim=-1)
        rope = target.rotary["default"].lookup(positions, max_position)
        *inputs, residual = self.layer.pre_attention(self.fc(x), None, rope)
        x, residual = self.layer.post_attention(
            self.layer.self_attn.attend(*inputs, meta, kv_cache), residual)
        return self.norm(x + residual)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].lm_head(hidden)

    def weight_targets(self) -> dict[str, WeightTarget]:
        n = self.names
        p = n.prefix
        t = self._target[0].layer_weight_targets(f"{p}{n.layer}", self.layer)
        t[f"{p}{n.fc}.weight"] = self.fc.part_target(0)
        for name, norm in ((n.embedding_norm, self.norm_embedding),
                           (n.hidden_norm, self.norm_hidden), (n.norm, self.norm)):
            t[f"{p}{name}.weight"] = WeightTarget(norm.weight)
        return t

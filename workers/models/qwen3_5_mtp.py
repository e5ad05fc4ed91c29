"""The multi-token-prediction (MTP) layer Qwen3.5, Qwen3.5-MoE and Qwen3-Next checkpoints
ship (``mtp.*``), run by the worker as the drafter of ``speculative_method="mtp"``
(``workers/mtp_proposer.py``).

Row t reads the target's hidden state at t (after its final norm) and the embedding of
token t + 1; each is normed, the two are joined (embedding first) and projected back to
the hidden width (``fc``); one full-attention decoder layer of the target's kind (gated
attention, and its dense MLP or experts) with its own KV cache; its norm. The target's
LM head turns the result into the guess of token t + 2, and the result itself stands in
for the target's hidden state when the layer guesses one more (``chain``). The embedding
and the head are the target's.
"""

from __future__ import annotations

from dataclasses import replace
import torch
from torch import nn

from pocketllm.errors import UnsupportedFeatureError

from ..layers.attention import AttentionMetadata
from ..layers.linear import ColumnParallelLinear, Shard
from ..layers.norm import RMSNorm
from .weight_targets import WeightTarget


class Qwen3_5MTP(nn.Module):
    PREFIX = "mtp."

    def __init__(self, target, backend):
        """``target``: the ``Qwen3_5ForCausalLM`` whose checkpoint holds the layer."""
        super().__init__()
        cfg, device, dtype = target.cfg, target.device, target.dtype
        if target.tp.world != 1:
            raise UnsupportedFeatureError("the MTP drafter runs at tensor-parallel size 1",
                                          "speculative_method")
        # one layer of full attention, routed where the target routes its layers
        self.cfg = replace(cfg, num_layers=1, layer_windows=[None], layer_rope=["default"],
                           linear_layers=[False], sparse_layers=[any(cfg.sparse_layers)])
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps, device)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps, device)
        self.fc = ColumnParallelLinear(2 * h, [Shard(0, 0, h, h)], False, device, dtype)
        self.layer = target.make_layer(self.cfg, 0, backend, device, dtype, target.tp)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, device)
        self._target = (target,)  # not a submodule: its parameters are the target's own

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int,
                hidden: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``input_ids`` [T] (token t + 1 of each row), ``hidden`` [T, H] (the target's
        normed hidden state at t, or a previous guess's ``forward``) -> [T, H], whose
        ``logits`` guess token t + 2."""
        target = self._target[0]
        x = torch.cat([self.pre_fc_norm_embedding(target.embed_tokens(input_ids)),
                       self.pre_fc_norm_hidden(hidden)], dim=-1)
        rope = target.rotary["default"].lookup(positions, max_position)
        *inputs, residual = self.layer.pre_attention(self.fc(x), None, rope)
        x, residual = self.layer.post_attention(
            self.layer.self_attn.attend(*inputs, meta, kv_cache), residual)
        return self.norm(x + residual)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].lm_head(hidden)

    def weight_targets(self) -> dict[str, WeightTarget]:
        target, p = self._target[0], self.PREFIX
        t = target.layer_weight_targets(f"{p}layers.0.", self.layer)
        t[f"{p}fc.weight"] = self.fc.part_target(0)
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            t[f"{p}{norm}.weight"] = WeightTarget(getattr(self, norm).weight)
        return t
